"""Attention backends: one interface, a torch implementation and a FlashInfer one.

Per step the runner builds one ``AttentionMetadata`` and calls ``backend.plan(meta, shape)``;
then every layer calls ``backend.forward(q, k, v, kv_layer)``, which first writes the new K/V
into their paged slots and then attends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .backend import AttentionBackend, AttentionShape
from .metadata import (
    MIN_CASCADE_SHARED_BLOCKS,
    AttentionMetadata,
    CascadeGroup,
    SeqSpec,
    plan_step_order,
)


def create_backend(
    name: str = "auto", device: torch.device | str = "cpu", *, batch_invariant: bool = True
) -> AttentionBackend:
    """``auto`` picks FlashInfer on CUDA when it is installed; on CPU the engine's kernels:
    ``cpu`` (batch-invariant, ``cpu_backend``) or, with ``batch_invariant`` off, ``cpu-split``
    (``split_backend``); each falls back to ``torch``, the reference, for shapes it lacks.
    FlashInfer takes ``batch_invariant`` too (a fixed split size, and cascade groups decoded
    plainly; see ``flashinfer_backend``)."""
    device = torch.device(device)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if name == "cpu" or (name == "auto" and device.type == "cpu" and batch_invariant):
        from .cpu_backend import CpuKernelBackend

        return CpuKernelBackend()
    if name == "cpu-split" or (name == "auto" and device.type == "cpu"):
        from .split_backend import SplitKernelBackend

        return SplitKernelBackend()
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend()
    if name == "flashinfer":
        if not on_cuda:
            raise ValueError(
                f"the flashinfer backend needs a CUDA device (got {device}, "
                f"cuda available: {torch.cuda.is_available()}); use backend 'torch' or 'auto'"
            )
        from .flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device, batch_invariant=batch_invariant)
    if name == "auto":
        if on_cuda:
            try:
                from .flashinfer_backend import FlashInferBackend

                return FlashInferBackend(device, batch_invariant=batch_invariant)
            except ImportError:
                pass
        from .torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(
        f"unknown attention backend {name!r}: expected auto, cpu, cpu-split, torch or flashinfer"
    )


def cpu_kernel_loads(
    name: str, batch_invariant: bool, dtype: torch.dtype = torch.bfloat16
) -> tuple[Callable[[], object], ...]:
    """What the backend ``create_backend(name, "cpu", batch_invariant=...)`` makes loads at
    its first step for ``dtype`` rows (its kernel library's ``load``), so that an engine can
    start building it before the model loads; () for the backends without one."""
    if name == "cpu" or (name == "auto" and batch_invariant):
        from .row_kernels import load_rows

        return (functools.partial(load_rows, dtype),)
    if name in ("cpu-split", "auto"):
        from .cpu_kernels import load

        return (load,)
    return ()


__all__ = [
    "MIN_CASCADE_SHARED_BLOCKS",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "CascadeGroup",
    "SeqSpec",
    "cpu_kernel_loads",
    "create_backend",
    "plan_step_order",
]
