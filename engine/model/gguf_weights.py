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

from .. import settings
from ..kernels import cpu_gemm, cpu_head_int8, cpu_qgemm
from ..kernels.gemm_blocks import BlockSource
from .gguf_blocks import BlockInts, split_blocks
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


def block_sources(
    ints: BlockInts | None,
    orders: list[np.ndarray | None],
    dtype: torch.dtype,
    device: torch.device,
    head: bool = False,
) -> list[BlockSource] | None:
    """A dequantized model's linear weight as its GGUF blocks (``ints``, the tensor's
    ``block_ints`` split: ``q`` int8 ``[n, k]``, ``scale`` and ``minimum`` or None float32),
    one per row order in ``orders`` (a fused tensor's parts, llama's q/k permutation undone): its bf16 GEMM runs
    from them (``cpu_gemm.PackedLinear.from_blocks``: on AMX; without it for calls of few
    rows), the same bits from under half the bytes; the LM head (``head``) also where only the
    integer head runs (``$PREFIXCACHE_INT8_HEAD=1``). None where neither can run
    (another dtype or device, a type ``gguf_blocks`` does not split)."""
    if ints is None or dtype != torch.bfloat16 or device.type != "cpu":
        return None
    if not settings.gguf_blocks_enabled():
        return None
    if not (cpu_gemm.reads_blocks() or (head and cpu_head_int8.wanted())):
        return None
    out: list[BlockSource] = []
    for order in orders:
        if order is None:
            out.append((ints.q, ints.scale, ints.minimum))
            continue
        minimum = None if ints.minimum is None else ints.minimum[order]
        out.append((ints.q[order], ints.scale[order], minimum))
    return out


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
