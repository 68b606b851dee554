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


def visible_keys(cached: int, new: int, window: int = 0) -> int:
    """Keys the ``new`` queries after ``cached`` tokens see in all: query at position p sees
    p + 1 keys, or ``min(p + 1, window)`` in a sliding-window layer."""
    full = new * cached + new * (new + 1) // 2
    if not window:
        return full
    # positions p in [cached, cached + new): sum of min(p + 1, window)
    ramp_end = min(max(window - 1, cached), cached + new)  # p < ramp_end sees p + 1 keys
    ramp = sum(range(cached + 1, ramp_end + 1))
    return ramp + (cached + new - ramp_end) * window


def prefill_flops(c: ModelConfig, cached: int, new: int) -> int:
    """FLOPs to compute ``new`` tokens after ``cached`` tokens already in the KV cache."""
    keys = sum(visible_keys(cached, new, c.window_of(i)) for i in range(c.num_layers))
    attention = 2 * 2 * c.num_heads * c.head_dim * keys
    lm_head = 2 * c.hidden_size * c.vocab_size
    return new * linear_flops_per_token(c) + attention + lm_head
