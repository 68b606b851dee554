"""The KV pages' storage dtype: the model's own (``auto``) or fp8 (``--kv-cache-dtype``).

fp8 pages hold each K and V element in one byte, with no scale (a scale of 1, vLLM's default
for ``fp8``): values are clamped to the format's largest finite value, then rounded to nearest
once, when they are written. Every fp8 value is exact in bf16 and fp32, so attention reads the
pages through to its compute dtype without a second rounding, and a key reads the same
whether it was written by this request, by the request that cached it, or by a batch-mate:
cached and uncached runs stay equal at fp8 as at bf16 (comparing fp8 with fp8).

``fp8`` is ``fp8_e4m3`` (4 exponent bits, 3 mantissa bits, largest 448): the precision K and
V need; ``fp8_e5m2`` trades a mantissa bit for range (largest 57344).
"""

from __future__ import annotations

import torch

from ..config import KV_CACHE_DTYPES

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_BY_NAME = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pages' dtype for ``--kv-cache-dtype name`` (``auto``: the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    return model_dtype if name == "auto" else _BY_NAME[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def name_of(dtype: torch.dtype) -> str:
    """``fp8_e4m3``, ``fp8_e5m2``, or the plain dtype name (``bfloat16``): for stats and logs."""
    if dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    return str(dtype).removeprefix("torch.")


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the pages store it: fp8 clamped to its finite range first (so that every
    device and torch version saturates alike; some casts give NaN), other dtypes a plain cast."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as attention reads it back from pages of ``dtype`` (itself when they hold its dtype)."""
    if dtype == x.dtype:
        return x
    return to_kv(x, dtype).to(x.dtype)
