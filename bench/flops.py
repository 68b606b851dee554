"""FLOP model of a Llama-family prefill, for the ideal speedup of a cached prefix.

Counts multiply-adds as 2 FLOPs: the linear layers per token, plus attention scores and the
weighted sum over every visible key (causal), plus the LM head for the one token sampled.
"""

from __future__ import annotations

from prefixcache.engine.model.model_config import ModelConfig


def linear_flops_per_token(c: ModelConfig) -> int:
    q = c.hidden_size * c.num_heads * c.head_dim
    kv = 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    o = c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return 2 * c.num_layers * (q + kv + o + mlp)


def prefill_flops(c: ModelConfig, cached: int, new: int) -> int:
    """FLOPs to compute ``new`` tokens after ``cached`` tokens already in the KV cache."""
    # query i (0-based among the new ones) sees cached + i + 1 keys
    visible_keys = new * cached + new * (new + 1) // 2
    attention = 2 * 2 * c.num_layers * c.num_heads * c.head_dim * visible_keys
    lm_head = 2 * c.hidden_size * c.vocab_size
    return new * linear_flops_per_token(c) + attention + lm_head
