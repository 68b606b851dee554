"""Gemma 3's text decoder over the engine's flat batch, as transformers' Gemma3ForCausalLM
computes it.

The same calling convention as ``llama.py`` (``forward(input_ids, positions, attend,
out_rows)``, ``compute_logits``, ``prepare``), its fused projections and rotary reused. What
Gemma changes: embeddings scaled by sqrt(hidden) (the scale rounded to the model dtype, as
transformers does), RMSNorm scaling by ``1 + weight`` in float32, a norm before and after both
attention and the MLP, per-head q/k norms before RoPE, a GeGLU MLP (tanh GELU), the attention
scale ``query_pre_attn_scalar ** -0.5``, sliding layers on their own rope base
(``rope_local_base_freq``, never scaled) and global ones on ``rope_theta`` with the config's
scaling, and an optional final logit softcap. Which layers slide is ``config.layer_windows``;
the window itself is applied by the attention backend behind ``attend``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .layer_ops import FUSED_OPS, TORCH_OPS
from .llama import (
    MLP,
    AttendFn,
    Attention,
    LlamaForCausalLM,
    Projection,
    RotaryEmbedding,
    Rotation,
    _Concat,
)
from .model_config import ModelConfig, UnsupportedModelError


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32, then cast back (not Llama's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        # The backends scale q.k by head_dim ** -0.5; Gemma's scale differs where
        # query_pre_attn_scalar != head_dim, and then q is scaled by the ratio first.
        self.q_scale = config.attention_scale * config.head_dim**0.5

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
        q = self.q_norm(qkv[:, : hq * d].view(t, hq, d))
        k = self.k_norm(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d))
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        cos, sin = rotation
        q, k = self.ops.rotary(q, k, cos, sin, None)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = attend(self.layer_idx, q, k, v).reshape(t, hq * d)
        if rows is not None:
            if rows.numel() == 0:
                return x.new_empty((0, x.shape[1]))
            o = o.index_select(0, rows)
        return self.out(o)


class Gemma3MLP(MLP):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up one GEMM once prepared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        i = self.intermediate_size
        return self.down(F.gelu(gate_up[:, :i], approximate="tanh") * gate_up[:, i:])


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

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        attend: AttendFn,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream after the layer; ``rows``: only those tokens go on past
        attention (every token's K/V is still written)."""
        h = self.self_attn(self.input_layernorm(x), rotation, attend, rows)
        if rows is not None:
            x = x.index_select(0, rows)
            if rows.numel() == 0:
                return x
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.attn_logit_softcapping is not None:
            raise UnsupportedModelError(
                "attention logit softcapping is not supported by the attention backends"
            )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)  # global layers: rope_theta and its scaling
        local = dataclasses.replace(
            config,
            rope_theta=config.rope_local_base_freq or config.rope_theta,
            rope_scaling=None,
        )
        self.rotary_emb_local = RotaryEmbedding(local)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers multiplies by the scale rounded to the weights' dtype
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        rotations = {
            False: self.rotary_emb(positions, x.dtype),
            True: self.rotary_emb_local(positions, x.dtype),
        }
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, rotations[layer.sliding], attend, out_rows if i == last else None)
        if not self.layers and out_rows is not None:
            x = x.index_select(0, out_rows)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 (text). A ``LlamaForCausalLM`` for ``prepare()`` (fused QKV and gate/up GEMMs,
    packed head) and the engine's typing; its own modules otherwise."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)  # type: ignore[assignment]
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head: Projection = _Concat(self.lm_head)
        self.prepared = False

    def set_fused_ops(self, fused: bool) -> None:
        """Only the rotary has a fused kernel here (bf16 CPU); Gemma's norms and GeGLU are
        torch's."""
        if fused and not self.prepared:
            raise ValueError("the fused ops run on prepare()d layers (the rotary is in place)")
        ops = FUSED_OPS if fused else TORCH_OPS
        for layer in self.model.layers:
            layer.self_attn.ops = ops
            layer.mlp.ops = ops

    @property
    def fused_ops(self) -> bool:
        layers = self.model.layers
        return bool(layers) and layers[0].self_attn.ops.fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
