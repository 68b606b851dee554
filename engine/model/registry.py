"""The model class for a config (picked by ``ModelConfig.model_type``), and how a
checkpoint's tensors map onto it where their names or shapes differ (Phi-3's fused
projections)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .model_config import ModelConfig

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "gemma2": Gemma3ForCausalLM,  # Gemma 3's decoder without q/k norms, with a softcap
    "gemma3": Gemma3ForCausalLM,
}


def causal_lm_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """Gemma's own decoder (Gemma 2, Gemma 3), or the Llama-family one (Llama, Mistral,
    Qwen2, Qwen3)."""
    return MODEL_CLASSES.get(config.model_type, LlamaForCausalLM)


def model_tensors(
    config: ModelConfig, name: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors for one checkpoint tensor: itself, or Phi-3's ``qkv_proj`` split
    into q/k/v (rows: the query heads, then the KV heads' keys, then their values) and its
    ``gate_up_proj`` into gate and up (the first half gates, as transformers' ``chunk(2)``)."""
    if config.model_type == "phi3":
        d = config.head_dim
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            sizes = [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d]
            if tensor.shape[0] == sum(sizes):
                q, k, v = tensor.split(sizes)
                yield from ((base + "q_proj.weight", q), (base + "k_proj.weight", k))
                yield base + "v_proj.weight", v
                return
        if name.endswith("mlp.gate_up_proj.weight") and tensor.shape[0] % 2 == 0:
            gate, up = tensor.chunk(2)
            base = name.removesuffix("gate_up_proj.weight")
            yield from ((base + "gate_proj.weight", gate), (base + "up_proj.weight", up))
            return
    yield name, tensor
