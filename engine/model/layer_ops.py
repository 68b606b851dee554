"""The decoder layer's elementwise ops, as one object chosen once per model: torch's ops, or
``kernels/cpu_layer_ops`` (bit-identical to torch's, one pass each: bf16 on AVX512_BF16
CPUs, fp32 on AVX2 + FMA ones, SiLU-and-mul there staying torch's). The model's forward
calls ``ops.<op>`` and never branches on which it holds; ``fused_ops_for(dtype)`` picks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu_layer_ops

QKNorms = tuple[torch.Tensor, torch.Tensor, float] | None  # (q weight, k weight, eps)
# Gemma's norms take ``scale = 1 + weight`` in fp32, computed once (GemmaRMSNorm.scale).


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _torch_gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * scale).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchLayerOps:
    """torch's ops: any dtype and device."""

    __slots__ = ()
    fused = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _torch_rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``."""
        residual = residual + x
        return _torch_rms_norm(residual, weight, eps), residual

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: QKNorms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k after the per-head q/k norms (where the model has them) and the rotation."""
        if norms is not None:
            q_weight, k_weight, eps = norms
            q, k = _torch_rms_norm(q, q_weight, eps), _torch_rms_norm(k, k_weight, eps)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        return F.silu(gate).mul_(up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """Gemma's GeGLU: ``gelu(gate, approximate="tanh") * up``."""
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        return F.gelu(gate, approximate="tanh") * up

    def gemma_rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        return _torch_gemma_rms_norm(x, scale, eps)

    def gemma_add_norms(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        post: torch.Tensor,
        pre: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + norm(h, post), pre), residual + norm(h, post))``."""
        residual = residual + _torch_gemma_rms_norm(h, post, eps)
        return _torch_gemma_rms_norm(residual, pre, eps), residual

    def gemma_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: QKNorms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary`` with Gemma's per-head norms (fp32 scales)."""
        if norms is not None:
            q_scale, k_scale, eps = norms
            q = _torch_gemma_rms_norm(q, q_scale, eps)
            k = _torch_gemma_rms_norm(k, k_scale, eps)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class FusedLayerOps(TorchLayerOps):
    """``cpu_layer_ops``: CPU tensors of a dtype it computes (``cpu_layer_ops.supports``)."""

    __slots__ = ()
    fused = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_layer_ops.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in one pass, reusing ``x``'s and ``residual``'s memory for the results."""
        return cpu_layer_ops.fused_add_rms_norm(x, residual, weight, eps)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: QKNorms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on q and k (views of the QKV GEMM's output), the norms in the same pass."""
        cpu_layer_ops.rotary_(q, k, cos, sin, norms)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return cpu_layer_ops.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return cpu_layer_ops.gelu_tanh_and_mul(gate_up)

    def gemma_rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_layer_ops.gemma_rms_norm(x, scale, eps)

    def gemma_add_norms(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        post: torch.Tensor,
        pre: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In one pass; ``residual`` updated in place."""
        return cpu_layer_ops.gemma_add_norms(h, residual, post, pre, eps)

    def gemma_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: QKNorms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_layer_ops.rotary_(q, k, cos, sin, norms, gemma_norms=True)
        return q, k


class FusedNormsLayerOps(FusedLayerOps):
    """``cpu_layer_ops``' norms and rotary, torch's SiLU- and GELU-and-mul (fp32)."""

    __slots__ = ()

    def silu_and_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return TorchLayerOps.silu_and_mul(self, gate_up, intermediate)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return TorchLayerOps.gelu_tanh_and_mul(self, gate_up, intermediate)


TORCH_OPS = TorchLayerOps()
FUSED_OPS = FusedLayerOps()
FUSED_NORMS_OPS = FusedNormsLayerOps()


def fused_ops_for(dtype: torch.dtype) -> TorchLayerOps | None:
    """The fused ops for a CPU model of ``dtype`` (None where ``cpu_layer_ops`` does not
    compute it here)."""
    if not cpu_layer_ops.computes(dtype):
        return None
    return FUSED_OPS if cpu_layer_ops.computes_silu_and_mul(dtype) else FUSED_NORMS_OPS


def require_fused_ops(dtype: torch.dtype) -> TorchLayerOps:
    """``fused_ops_for(dtype)``, or a clear error where none compute it here."""
    ops = fused_ops_for(dtype)
    if ops is None:
        raise ValueError(f"cpu_layer_ops does not compute {dtype} here")
    return ops
