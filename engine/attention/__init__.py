"""Attention backends: one interface, a torch implementation and a FlashInfer one.

Per step the runner builds one ``AttentionMetadata`` and calls ``backend.plan(meta, shape)``;
then every layer calls ``backend.forward(q, k, v, kv_layer)``, which first writes the new K/V
into their paged slots and then attends.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .metadata import (
    MIN_CASCADE_SHARED_BLOCKS,
    AttentionMetadata,
    CascadeGroup,
    SeqSpec,
    plan_step_order,
)


@dataclass(slots=True, frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


class AttentionBackend(ABC):
    name: str = ""

    def prepare(self, shape: AttentionShape, device: torch.device) -> None:  # noqa: B027
        """Once, before the first step: build or load what the backend needs for this shape
        (so that no request waits for it)."""

    @abstractmethod
    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        """Prepare for one step; the same plan serves every layer."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v ``[T, Hk, D]`` into ``kv_layer`` ``[num_blocks, 2, block_size, Hk, D]``,
        then return attention output ``[T, Hq, D]`` for queries ``q`` ``[T, Hq, D]``."""


def create_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """``auto`` picks FlashInfer on CUDA when it is installed, else torch."""
    device = torch.device(device)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
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

        return FlashInferBackend(device)
    if name == "auto":
        if on_cuda:
            try:
                from .flashinfer_backend import FlashInferBackend

                return FlashInferBackend(device)
            except ImportError:
                pass
        from .torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown attention backend {name!r}: expected auto, torch or flashinfer")


__all__ = [
    "MIN_CASCADE_SHARED_BLOCKS",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "CascadeGroup",
    "SeqSpec",
    "create_backend",
    "plan_step_order",
]
