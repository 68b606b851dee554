"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

``forward`` takes every token of a step flattened into one ``[T]`` tensor with its position,
and an ``attend(layer, q, k, v)`` callback that writes K/V into the paged cache and attends.
Parameter names match Hugging Face checkpoints, so a safetensors state dict loads as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ..kernels import cpu_layer_ops
from ..kernels.gemm_blocks import BlockSource
from ..kernels.linear import Gemm
from .layer_ops import TORCH_OPS, TorchLayerOps, require_fused_ops
from .model_config import ModelConfig
from .quantized_linear import QLinear, embed_from_head, fused_kernel
from .rope import RotaryEmbedding, Rotation


class AttendFn(Protocol):
    """One layer's attention: K/V of every token written, then the output of each query row
    ``[T, Hq, D]``, or of ``rows`` only ``[len(rows), Hq, D]`` (the last layer's logits rows)."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops: TorchLayerOps = TORCH_OPS  # LlamaForCausalLM.set_fused_ops() chooses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: the residual add fused into the norm."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        o_bias = bias and config.model_type != "qwen2"  # Qwen2 biases q/k/v only
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.use_rope = config.uses_rope(layer_idx)
        # The projections: the checkpoint's linears until prepare() fuses and packs them.
        self.qkv: Projection = _Concat(self.q_proj, self.k_proj, self.v_proj)
        self.out: Projection = _Concat(self.o_proj)
        self.ops: TorchLayerOps = TORCH_OPS  # LlamaForCausalLM.set_fused_ops() chooses

    def link_projections(self) -> None:
        """The unfused projections over the current q/k/v/o modules (after a loader swaps in
        ``QLinear``s)."""
        self.qkv = _Concat(self.q_proj, self.k_proj, self.v_proj)
        self.out = _Concat(self.o_proj)

    def prepare(self, batch_invariant: bool = True) -> None:
        """One [q; k; v] GEMM; q/k/v_proj.weight become views of its weight (same names),
        let go once the batch-invariant kernel has packed it (``release_weights``)."""
        self.qkv = fused_projection((self.q_proj, self.k_proj, self.v_proj), batch_invariant)
        self.out = fused_projection((self.o_proj,), batch_invariant)
        release_weights((self.q_proj, self.k_proj, self.v_proj), self.qkv)
        release_weights((self.o_proj,), self.out)

    def qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        attend: AttendFn,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output ``[T, hidden]``, or only for ``rows`` (K/V of every token are still
        written to the cache)."""
        t = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        q, k, v = qkv.view(t, hq + 2 * hk, d).split((hq, hk, hk), dim=1)  # views, one op
        cos, sin = rotation  # applied before K is written to the cache
        if self.use_rope:  # SmolLM3's NoPE layers attend unrotated
            q, k = self.ops.rotary(q, k, cos, sin, self.qk_norms())
        o = attend(self.layer_idx, q, k, v, *(() if rows is None else (rows,)))
        if o.shape[0] == 0:  # no rows kept: K/V written alone
            return x.new_empty((0, x.shape[1]))
        return self.out(o.reshape(o.shape[0], hq * d))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.intermediate_size = i
        self.gate_up: Projection = _Concat(self.gate_proj, self.up_proj)  # until prepare()
        self.down: Projection = _Concat(self.down_proj)
        self.ops: TorchLayerOps = TORCH_OPS  # LlamaForCausalLM.set_fused_ops() chooses

    def link_projections(self) -> None:
        self.gate_up = _Concat(self.gate_proj, self.up_proj)
        self.down = _Concat(self.down_proj)

    def prepare(self, batch_invariant: bool = True) -> None:
        self.gate_up = fused_projection((self.gate_proj, self.up_proj), batch_invariant)
        self.down = fused_projection((self.down_proj,), batch_invariant)
        release_weights((self.gate_proj, self.up_proj), self.gate_up)
        release_weights((self.down_proj,), self.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.silu_and_mul(self.gate_up(x), self.intermediate_size))


Projection = Callable[[torch.Tensor], torch.Tensor]  # a linear, a _Concat, a Gemm or a kernel


class _Concat:
    """Linears applied to the same input, outputs side by side: the checkpoint's q/k/v (or
    gate/up) projections before ``prepare()`` fuses them into one GEMM (same bits), or the
    parts of a fused projection that cannot share one kernel. A plain object, not a module,
    so that the state dict keeps the checkpoint's names only."""

    __slots__ = ("linears",)

    def __init__(self, *linears: Projection) -> None:
        self.linears = linears

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            return self.linears[0](x)
        return torch.cat([lin(x) for lin in self.linears], dim=-1)


def fused_projection(
    linears: tuple[nn.Module, ...], batch_invariant: bool, float_out: bool = False
) -> Projection:
    """Linears applied side by side as one GEMM: ``Gemm`` over the concatenated weights, or
    for GGUF-quantized ones (``QLinear``, batch-invariant always) one quantized kernel where
    their packings concatenate, else each on its own kernel. ``float_out``: one linear (the
    LM head) whose batch-invariant GEMM keeps its fp32 sums (``Gemm``)."""
    if all(isinstance(lin, nn.Linear) for lin in linears):
        # a GGUF model's blocks (gguf_loader); packed now, or not used here
        sources = [lin.__dict__.pop("block_source", None) for lin in linears]
        source = _fuse_sources(sources)
        if len(linears) == 1:
            lin = linears[0]
            return Gemm(lin.weight, lin.bias, batch_invariant, float_out, source)
        weight, bias = _fuse_linears(*linears)  # type: ignore[arg-type]
        return Gemm(weight, bias, batch_invariant, source=source)
    fused = fused_kernel(linears)
    if fused is not None:
        return fused
    parts: list[Projection] = []
    for lin in linears:
        if isinstance(lin, QLinear):
            parts.append(lin.kernel)
        else:
            parts.append(Gemm(lin.weight, lin.bias, batch_invariant))  # type: ignore[arg-type]
    return _Concat(*parts)


def release_weights(linears: tuple[nn.Module, ...], projection: Projection) -> None:
    """Once ``projection``'s batch-invariant kernel has packed its own copy, the linears'
    weights (and the fused weight they view) are let go: each parameter becomes a meta tensor
    of its name, shape and dtype (reading its values raises), so a bf16 model no longer holds
    its layer weights twice. Never the head's (it may be the embedding table)."""
    if not isinstance(projection, Gemm) or projection.invariant is None:
        return
    projection.weight = projection.weight.to("meta")
    for lin in linears:
        lin.weight = nn.Parameter(lin.weight.to("meta"), requires_grad=False)


def _fuse_sources(sources: list[BlockSource | None]) -> BlockSource | None:
    """Linears' GGUF blocks stacked as their fused weight's, where each has them and the
    minimums agree on being there."""
    if any(s is None for s in sources):
        return None
    parts = [s for s in sources if s is not None]
    if len(parts) == 1:
        return parts[0]
    if len({s[2] is None for s in parts}) != 1:
        return None
    minimum = None if parts[0][2] is None else np.concatenate([s[2] for s in parts])  # type: ignore[misc]
    scales = [s[1] for s in parts]
    if len({sc.shape[1] for sc in scales}) > 1:  # Q6_K's per-16 scales beside per-32 ones
        if minimum is not None:
            return None
        per16 = max(sc.shape[1] for sc in scales)
        scales = [sc if sc.shape[1] == per16 else np.repeat(sc, 2, axis=1) for sc in scales]
    return np.concatenate([s[0] for s in parts]), np.concatenate(scales), minimum


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output dim and re-point each
    linear's parameters at its slice, so the state dict keeps its names and memory is not
    doubled. Returns the fused (weight, bias) for ``F.linear``."""
    weight = torch.cat([lin.weight for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    assert all(has_bias) or not any(has_bias), "fused linears have biases on all or none"
    bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None  # type: ignore[misc]
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        attend: AttendFn,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's MLP output and the residual stream before it is added: the caller
        adds the two in the next norm (``add_and_norm``), so the add costs no pass of its own.
        ``residual`` None: ``x`` is the embedding (the first layer). ``rows``: only those
        tokens go on past attention (the last layer, where only some outputs are read)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        # .forward: no hooks here, and nn.Module's call costs ~2 us (bench/step_overhead.py)
        h = self.self_attn.forward(h, rotation, attend, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
            if rows.numel() == 0:
                return h, residual
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h), residual


def token_embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(rows, dim)``; built on the meta device (the loaders, which assign the
    checkpoint's table) its weight is left uninitialized: a meta ``normal_`` imports
    torch._dynamo, 1.3-1.9 s of every engine's start."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rotation = self.rotary_emb(positions, x.dtype)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = out_rows if i == last else None
            x, residual = layer.forward(x, residual, rotation, attend, rows)
        if residual is None:  # no layers
            return self.norm(x if out_rows is None else x.index_select(0, out_rows))
        if x.shape[0] == 0:
            return x
        return self.norm.add_and_norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head: Projection = _Concat(self.lm_head)  # a Gemm once prepare()d
        self.prepared = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for flat ``input_ids``/``positions`` ``[T]``, or
        ``[len(out_rows), hidden]`` for those tokens only: every layer still writes every
        token's K/V, but the last one takes only ``out_rows`` past its attention (a prefill's
        other tokens skip the last O projection and MLP, about 1/num_layers of its GEMMs)."""
        return self.model(input_ids, positions, attend, out_rows)

    def prepare(self, batch_invariant: bool = True) -> None:
        """For serving, once the weights are loaded: fused QKV and gate/up GEMMs (fewer, larger
        matmuls per layer), weights pre-packed (see ``Gemm``; ``batch_invariant``: on the
        kernel whose rows do not depend on their batch), and on CPU the norms, rotary (and
        for bf16 SiLU-and-mul) in ``cpu_layer_ops`` where it computes the model's dtype.
        Idempotent."""
        if self.prepared:
            return
        self.prepared = True
        for layer in self.model.layers:
            layer.self_attn.prepare(batch_invariant)
            layer.mlp.prepare(batch_invariant)
        # fp32 logits: a bf16 rounding of the head's sums ties the argmax between tokens that
        # the sums tell apart (SmolLM2 at bf16, tests/test_real_model.py's tenth question)
        self.head = fused_projection((self.lm_head,), batch_invariant, float_out=True)
        embed_from_head(self)
        dtype = self.model.norm.weight.dtype
        self.set_fused_ops(
            cpu_layer_ops.supports(self.model.norm.weight)
            # meta: a layer weight its packed GEMM let go (release_weights)
            and all(
                p.dtype == dtype and p.device.type in ("cpu", "meta") for p in self.parameters()
            )
        )

    def link_projections(self) -> None:
        """The unfused projections over the current modules, after a loader swapped some for
        ``QLinear``s (``gguf_loader``)."""
        for layer in self.model.layers:
            layer.self_attn.link_projections()
            layer.mlp.link_projections()
        self.head = _Concat(self.lm_head)

    def set_fused_ops(self, fused: bool) -> None:
        """Norms, rotary and SiLU-and-mul on ``cpu_layer_ops`` (``layer_ops.require_fused_ops``) or on
        torch's ops, for every layer at once. ``prepare()`` chooses; benches and tests switch
        to compare."""
        if fused and not self.prepared:
            raise ValueError("the fused ops run on prepare()d layers (the rotary is in place)")
        ops = require_fused_ops(self.model.norm.weight.dtype) if fused else TORCH_OPS
        modules = [self.model.norm]
        for layer in self.model.layers:
            modules += [layer.input_layernorm, layer.post_attention_layernorm]
            modules += [layer.self_attn, layer.mlp]
        for module in modules:
            module.ops = ops

    @property
    def fused_ops(self) -> bool:
        """Whether the layers run ``cpu_layer_ops`` (see ``set_fused_ops``)."""
        return self.model.norm.ops.fused

    def layer_inv_freqs(self) -> list[torch.Tensor]:
        """Each layer's RoPE frequencies, as its keys were rotated (chunk_reuse shifts them;
        a NoPE layer's are zeros: shifting its keys changes nothing)."""
        inv_freq = self.model.rotary_emb.inv_freq_cpu
        layers = self.model.layers
        return [inv_freq if layer.self_attn.use_rope else inv_freq * 0 for layer in layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
