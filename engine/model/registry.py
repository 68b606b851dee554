"""The model class for a config (picked by ``ModelConfig.model_type``), and how a
checkpoint's tensors map onto it where their names or shapes differ: llama.cpp's tensor names,
and Phi-3's fused projections."""

from __future__ import annotations

import re
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
    Qwen2, Qwen3, Phi-3)."""
    return MODEL_CLASSES.get(config.model_type, LlamaForCausalLM)


# llama.cpp's tensor names (gguf's tensor maps) -> the Hugging Face names the models use.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms per layer (gguf's tensor maps for MODEL_ARCH.GEMMA2 and GEMMA3).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused projections, split at load (fused_parts)
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor of ``arch`` (None: none the engine uses)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch in ("gemma2", "gemma3") else _LAYER_NAMES
    names = _PHI3_LAYER_NAMES if arch == "phi3" else names
    if (m := _LAYER_TENSOR.fullmatch(gguf_name)) and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def fused_parts(config: ModelConfig, name: str) -> list[tuple[str, int, int]] | None:
    """The model's tensors inside one fused checkpoint tensor, as (name, first row, end row):
    Phi-3's ``qkv_proj`` (the query heads' rows, then the KV heads' keys, then their values)
    and ``gate_up_proj`` (gate first, as transformers' ``chunk(2)``); None for any other."""
    if config.model_type != "phi3":
        return None
    if name.endswith("self_attn.qkv_proj.weight"):
        base, d = name.removesuffix("qkv_proj.weight"), config.head_dim
        q, kv = config.num_heads * d, config.num_kv_heads * d
        parts = [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)]
    elif name.endswith("mlp.gate_up_proj.weight"):
        base, inter = name.removesuffix("gate_up_proj.weight"), config.intermediate_size
        parts = [("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)]
    else:
        return None
    return [(f"{base}{part}.weight", a, b) for part, a, b in parts]


# A multimodal checkpoint's text decoder, named as the text model's (transformers' own
# checkpoints write the first form, its later conversion the second); the rest is not read.
_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model."}
_TEXT_HEAD = ("language_model.lm_head.weight", "lm_head.weight")
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_NOT_TEXT += ("model.multi_modal_projector.", "visual.", "model.visual.")  # + Qwen-VL's


def model_tensors(
    config: ModelConfig, name: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors for one checkpoint tensor: itself, its text decoder's name in a
    multimodal checkpoint (none for the vision tower's), or its ``fused_parts`` (a fused
    tensor of another size is left whole, for the shape check to name)."""
    if config.architecture.endswith("ForConditionalGeneration"):
        if name.startswith(_NOT_TEXT):
            return
        for prefix, text in _TEXT_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                name = text + name.removeprefix(prefix)
        name = _TEXT_HEAD[1] if name == _TEXT_HEAD[0] else name
    parts = fused_parts(config, name)
    if parts is None or tensor.shape[0] != parts[-1][2]:
        yield name, tensor
        return
    for part, a, b in parts:
        yield part, tensor[a:b]
