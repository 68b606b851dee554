"""Shared by the CPU layer-ops tests: the dtypes to run (each skipped where this build does not
compute it) and seeded random tensors."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.kernels import cpu_layer_ops

REASON = cpu_layer_ops.unavailable_reason()
DTYPES = [
    pytest.param(
        dtype,
        id=str(dtype).removeprefix("torch."),
        marks=pytest.mark.skipif(
            REASON is not None or not cpu_layer_ops.computes(dtype),
            reason=f"CPU layer ops do not compute {dtype} here ({REASON or 'this build'})",
        ),
    )
    for dtype in (torch.bfloat16, torch.float32)
]


def rand(
    *shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)
