"""Which GGUF weights stay quantized in memory, and putting them in the model.

``--gguf-weights``: ``dequantized`` (every tensor to the engine dtype at load, as before),
``quantized`` (the linears and the embedding whose type ``gguf_blocks`` splits stay packed for
``kernels/cpu_qgemm``; other tensors are dequantized) or ``auto`` (quantized where it can run:
a CPU model in a dtype the kernel computes here, bf16 on AVX512_BF16 and fp32 on AVX2 + FMA;
else dequantized). Quantized logits differ from
the dequantized ones (rounding), so the mode is part of the model fingerprint.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..kernels import cpu_qgemm
from .gguf_blocks import split_blocks
from .llama import LlamaForCausalLM
from .quantized_linear import QEmbedding, QLinear

WEIGHT_MODES = ("auto", "quantized", "dequantized")
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_LINEAR_SUFFIXES = ("_proj.weight",)


def quantized_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why quantized weights cannot run here (None when they can)."""
    if device.type != "cpu":
        return f"the kernel runs on CPU, not {device.type}"
    return cpu_qgemm.dtype_reason(dtype)


def resolve_mode(mode: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether to keep weights quantized; ``quantized`` where it cannot run is an error."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"gguf weights {mode!r}: use one of {', '.join(WEIGHT_MODES)}")
    if mode == "dequantized":
        return False
    reason = quantized_reason(dtype, device)
    if mode == "quantized" and reason is not None:
        raise ValueError(f"--gguf-weights quantized: {reason}")
    return reason is None


def quantizable_name(hf_name: str) -> bool:
    return hf_name in (EMBEDDING, HEAD) or hf_name.endswith(_LINEAR_SUFFIXES)


def q8_head_source(t: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A dequantized model's LM head tensor as its Q8_0 integers and scales (``q`` int8
    ``[n, k]``, ``scale`` float32 ``[n, k / 32]``), or None for another type: its bf16 GEMM
    runs from them (``cpu_gemm.PackedLinear.from_q8``), the same logits from half the bytes."""
    if t.tensor_type.name != "Q8_0":
        return None
    n, k = (int(d) for d in reversed(t.shape.tolist()))
    ints = split_blocks(t.data, "Q8_0", n, k)
    return None if ints is None else (ints.q, ints.scale)


def pack_tensor(t: Any, row_order: np.ndarray | None = None) -> cpu_qgemm.QuantizedWeight | None:
    """A GGUF tensor ``[n, k]`` packed for the kernel, rows taken in ``row_order`` (llama's
    q/k permutation undone); None for a type ``gguf_blocks`` keeps dequantized."""
    n, k = (int(d) for d in reversed(t.shape.tolist()))
    ints = split_blocks(t.data, t.tensor_type.name, n, k)
    if ints is None:
        return None
    q, scale, minimum = ints.q, ints.scale, ints.minimum
    if row_order is not None:
        q, scale = q[row_order], scale[row_order]
        minimum = None if minimum is None else minimum[row_order]
    return cpu_qgemm.QuantizedWeight.pack(q, scale, minimum)


def install(
    model: LlamaForCausalLM,
    packed: dict[str, cpu_qgemm.QuantizedWeight],
    tied: bool,
    dtype: torch.dtype,
) -> None:
    """Swap the modules whose weights are in ``packed`` (HF names) for quantized ones
    computing in ``dtype``; a tied head shares the embedding's packing."""
    for name, weight in packed.items():
        path = name.removesuffix(".weight")
        if name == EMBEDDING:
            model.set_submodule(path, QEmbedding(weight, dtype))
            continue
        old = model.get_submodule(path)
        model.set_submodule(path, QLinear(weight, getattr(old, "bias", None)))
    if tied and EMBEDDING in packed:
        model.lm_head = QLinear(packed[EMBEDDING])
    model.link_projections()


def quantized_fingerprint(fingerprint: str) -> str:
    return hashlib.sha256(f"{fingerprint}|gguf-weights=quantized".encode()).hexdigest()[:32]
