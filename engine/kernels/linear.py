"""How a linear layer whose weight is fixed at load runs on CPU: ``Gemm`` picks the kernel once
(the batch-invariant ``cpu_gemm`` where it loads, else oneDNN's packed bf16 GEMM or MKL) and
is then called per step. The models' projections (``model/llama.py``) are ``Gemm``s."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_gemm, cpu_head_int8, gemm_blocks, torch_private


class Gemm:
    """``x @ weight.T + bias`` for a weight fixed at load.

    ``batch_invariant`` (the default) runs ``cpu_gemm``'s kernel where it loads: a row's
    result is then the same whatever else shares the call. Otherwise bf16 weights on CPU are
    reordered once into oneDNN's blocked layout (1.4x faster than a plain bf16 ``linear`` at
    32 rows, 2.5x at one, which reorders the weight on every call), and fp32 runs MKL.
    ``float_out`` (the LM head): the invariant kernel returns its fp32 sums unrounded.
    ``source``: the weight's GGUF blocks (integers, scales, minimums or None); where AMX runs
    and ``weight`` is their bf16 rounding, the invariant kernel reads them instead (the same
    bits, 0.4-0.5x the bytes); with ``$PREFIXCACHE_INT8_HEAD=1`` the LM head's Q8_0 blocks run
    the integer head (``cpu_head_int8.cpp``: nearer the exact product, not those bits)."""

    __slots__ = ("bias", "invariant", "packed", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_invariant: bool = True,
        float_out: bool = False,
        source: gemm_blocks.BlockSource | None = None,
    ) -> None:
        self.weight, self.bias = weight, bias
        self.invariant: cpu_gemm.PackedLinear | None = None
        self.packed: torch.Tensor | None = None
        if batch_invariant and cpu_gemm.supports(weight):
            if source is not None and float_out and cpu_head_int8.wanted():  # the LM head
                self.invariant = cpu_head_int8.head_from_blocks(weight, bias, source)
            if source is not None and self.invariant is None:
                self.invariant = cpu_gemm.PackedLinear.from_blocks(weight, bias, source, float_out)
            if self.invariant is None:
                self.invariant = cpu_gemm.PackedLinear(weight, bias, float_out)
        elif weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _MKLDNN:
            self.packed = torch_private.onednn_pack_weight(weight, _PACK_ROWS_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            return self.invariant(x)
        if self.packed is not None:
            return torch_private.onednn_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


_MKLDNN = torch_private.onednn_linear_available()
_PACK_ROWS_HINT = 32  # oneDNN's layout choice; any row count runs on it
