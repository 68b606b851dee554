"""Gemma 3's and Gemma 2's text decoders over the engine's flat batch, as transformers'
Gemma3ForCausalLM and Gemma2ForCausalLM compute them.

The same calling convention as ``llama.py`` (``forward(input_ids, positions, attend,
out_rows)``, ``compute_logits``, ``prepare``), its fused projections and rotary reused. What
Gemma changes: embeddings scaled by sqrt(hidden) (the scale rounded to the model dtype, as
transformers does), RMSNorm scaling by ``1 + weight`` in float32, a norm before and after both
attention and the MLP, per-head q/k norms before RoPE, a GeGLU MLP (tanh GELU), the attention
scale ``query_pre_attn_scalar ** -0.5``, sliding layers on their own rope base
(``rope_local_base_freq``, never scaled) and global ones on ``rope_theta`` with the config's
scaling, and an optional final logit softcap. Which layers slide is ``config.layer_windows``;
the window itself is applied by the attention backend behind ``attend``.

Gemma 2 is the same decoder without the q/k norms, with one rope base for every layer and an
attention logit softcap (``cap * tanh(score / cap)``), which the attention backends apply
(``AttentionShape.softcap``, set from ``config.attn_logit_softcapping``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .layer_ops import TORCH_OPS, TorchLayerOps, require_fused_ops
from .llama import (
    MLP,
    AttendFn,
    Attention,
    LlamaForCausalLM,
    Projection,
    _Concat,
    token_embedding,
)
from .model_config import ModelConfig
from .rope import RotaryEmbedding, Rotation


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32, then cast back (not Llama's order).
    The layers call ``ops.gemma_*`` with ``scale``; ``forward`` is the same on torch's ops."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.frozen_scale: torch.Tensor | None = None  # freeze(): once the weights are loaded

    @property
    def scale(self) -> torch.Tensor:
        """``1 + weight`` in float32, as transformers computes it on every call."""
        if self.frozen_scale is not None:
            return self.frozen_scale
        return 1.0 + self.weight.float()

    def freeze(self) -> None:
        self.frozen_scale = (1.0 + self.weight.detach().float()).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_OPS.gemma_rms_norm(x, self.scale, self.eps)


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm: GemmaRMSNorm | None = None  # Gemma 3 only
        self.k_norm: GemmaRMSNorm | None = None
        if config.model_type == "gemma3":
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        attend: AttendFn,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        q, k, v = qkv.view(t, hq + 2 * hk, d).split((hq, hk, hk), dim=1)  # views, one op
        cos, sin = rotation
        q, k = self.ops.gemma_rotary(q, k, cos, sin, self.qk_norms())
        o = attend(self.layer_idx, q, k, v, *(() if rows is None else (rows,)))
        if o.shape[0] == 0:  # no rows kept: K/V written alone
            return x.new_empty((0, x.shape[1]))
        return self.out(o.reshape(o.shape[0], hq * d))

    def qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Gemma 3's per-head q/k norms (fp32 ``1 + weight``), None for Gemma 2."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm.scale, self.k_norm.scale, self.q_norm.eps


class Gemma3MLP(MLP):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up one GEMM once prepared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.gelu_tanh_and_mul(self.gate_up(x), self.intermediate_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = config.window_of(layer_idx) > 0
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.eps = eps
        self.ops: TorchLayerOps = TORCH_OPS  # Gemma3ForCausalLM.set_fused_ops() chooses

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        rotation: Rotation,
        attend: AttendFn,
        next_scale: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual, next normed)``: the residual stream after the layer, and it through
        the next norm (``next_scale``: the next layer's input norm, or the final one), so
        that each post-norm, its residual add and the next pre-norm are one pass. ``normed``:
        ``x`` through this layer's input norm. ``rows``: only those tokens go on past
        attention (every token's K/V is still written)."""
        h = self.self_attn.forward(normed, rotation, attend, rows)  # no hooks: see llama.py
        if rows is not None:
            x = x.index_select(0, rows)
            if rows.numel() == 0:
                return x, x
        post, pre = self.post_attention_layernorm.scale, self.pre_feedforward_layernorm.scale
        normed, x = self.ops.gemma_add_norms(h, x, post, pre, self.eps)
        h = self.mlp.forward(normed)
        post = self.post_feedforward_layernorm.scale
        normed, x = self.ops.gemma_add_norms(h, x, post, next_scale, self.eps)
        return x, normed


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)  # global layers: rope_theta and its scaling
        self.rotary_emb_local = self.rotary_emb  # Gemma 2: every layer on it
        if config.rope_local_base_freq is not None:
            local = dataclasses.replace(
                config, rope_theta=config.rope_local_base_freq, rope_scaling=None
            )
            self.rotary_emb_local = RotaryEmbedding(local)
        self.ops: TorchLayerOps = TORCH_OPS  # the first layer's input norm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings times sqrt(hidden), the scale rounded to the weights' dtype
        first, as transformers does."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        rotations = {
            False: self.rotary_emb(positions, x.dtype),
            True: self.rotary_emb_local(positions, x.dtype),
        }
        layers = list(self.layers)
        if not layers:
            if out_rows is not None:
                x = x.index_select(0, out_rows)
            return self.norm(x)
        normed = self.ops.gemma_rms_norm(x, layers[0].input_layernorm.scale, self.norm.eps)
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            next_norm = self.norm if last else layers[i + 1].input_layernorm
            x, normed = layer.forward(
                x,
                normed,
                rotations[layer.sliding],
                attend,
                next_norm.scale,
                out_rows if last else None,
            )
        return normed


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 (text), and Gemma 2. A ``LlamaForCausalLM`` for ``prepare()`` (fused QKV and
    gate/up GEMMs, packed head) and the engine's typing; its own modules otherwise."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)  # type: ignore[assignment]
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head: Projection = _Concat(self.lm_head)
        self.prepared = False

    def prepare(self, batch_invariant: bool = True) -> None:
        """``LlamaForCausalLM.prepare``, with every norm's ``1 + weight`` computed once."""
        if not self.prepared:
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.freeze()
        super().prepare(batch_invariant)

    def set_fused_ops(self, fused: bool) -> None:
        """The norms (with their residual adds), the rotary with the q/k norms and (bf16) the
        GeGLU run fused on CPU (bf16, or fp32)."""
        if fused and not self.prepared:
            raise ValueError("the fused ops run on prepare()d layers (the rotary is in place)")
        ops = require_fused_ops(self.model.norm.weight.dtype) if fused else TORCH_OPS
        self.model.ops = ops
        for layer in self.model.layers:
            layer.ops = ops
            layer.self_attn.ops = ops
            layer.mlp.ops = ops

    @property
    def fused_ops(self) -> bool:
        layers = self.model.layers
        return bool(layers) and layers[0].self_attn.ops.fused

    def layer_inv_freqs(self) -> list[torch.Tensor]:
        """Sliding layers rotate by the local rope base, global ones by ``rope_theta``."""
        local, full = self.model.rotary_emb_local, self.model.rotary_emb
        return [(local if layer.sliding else full).inv_freq_cpu for layer in self.model.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
