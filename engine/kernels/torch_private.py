"""The private torch ops the engine calls, in this one module: each behind a named function,
and ``missing_ops()`` to say which the installed torch lacks (tests/test_torch_private.py
fails loudly on an upgrade that removes one, rather than a user's first request).

- ``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``: a bf16 weight reordered
  once into oneDNN's blocked layout, then used as is (a plain bf16 ``linear`` reorders on
  every call). Only with batch invariance off (``cpu_gemm`` is the default), and only where
  ``mkldnn._is_mkldnn_bf16_supported`` says the CPU can run it.
- ``aten._scaled_dot_product_flash_attention_for_cpu``: torch's CPU flash attention with its
  log-sum-exp, which the public ``scaled_dot_product_attention`` does not return (the
  reference backend merges partial states by it).
"""

from __future__ import annotations

import torch

OPS = (
    ("mkldnn", "_reorder_linear_weight"),
    ("mkldnn", "_linear_pointwise"),
    ("mkldnn", "_is_mkldnn_bf16_supported"),
    ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
)


def missing_ops() -> list[str]:
    """The ops of ``OPS`` this torch build lacks (empty when all are there)."""
    return [f"{ns}.{name}" for ns, name in OPS if not hasattr(getattr(torch.ops, ns), name)]


def onednn_linear_available() -> bool:
    """Whether oneDNN's pre-packed bf16 linear can run here (its reorder refuses CPUs without
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT, such as AVX2-only ones)."""
    return (
        torch.backends.mkldnn.is_available()
        and not missing_ops()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def onednn_pack_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout (any row count runs on it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def flash_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of torch's CPU flash attention over ``[B, H, L, D]`` operands (the LSE
    natural-log, ``[B, H, Lq]``)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return out[0], out[1]
