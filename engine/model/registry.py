"""The model class for a config: picked by ``ModelConfig.model_type``."""

from __future__ import annotations

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
