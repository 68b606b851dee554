"""The attention backend interface: what the model runner plans and calls per layer."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from . import row_kernels
from .kv_dtype import to_kv
from .metadata import AttentionMetadata


@dataclass(slots=True, frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # q, k, v and the output
    kv_dtype: torch.dtype | None = None  # the pages' (None: dtype); fp8 (kv_dtype.py) or dtype
    softcap: float = 0.0  # > 0: scores capped as softcap * tanh(s / softcap) (Gemma 2)
    sm_scale: float | None = None  # q.k's scale where not head_dim ** -0.5 (Gemma's 27B)

    @property
    def page_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.sm_scale is None else self.sm_scale


class AttentionBackend(ABC):
    name: str = ""
    # whether a row's output is the same bits whatever shares its step (CPU kernels, FlashInfer
    # with fixed splits); the torch reference's padded and cascaded batches are not
    batch_invariant: bool = False
    supports_window: bool = (
        False  # honours AttentionMetadata.window (a hybrid model's sliding layers)
    )

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

    def forward_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` whose output only ``rows`` (int64 indices into q's rows) are read: K/V
        of every token written, attention output ``[len(rows), Hq, D]`` for those rows, in
        their order (the model's last layer, whose other rows have no logits to give). A
        backend computes only those rows where that gives each the bits ``forward`` gives
        it; this one computes every row (none where it can ``write`` alone)."""
        if rows.numel() == 0 and self.write(k, v, kv_layer):
            return q.new_empty((0, *q.shape[1:]))
        return self.forward(q, k, v, kv_layer).index_select(0, rows)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        """The step's K/V written alone, as ``forward`` writes them, where this backend can
        (False: it cannot; nothing written)."""
        return False


# Steps of up to this many tokens (decodes, short suffixes) compute write_rows in Python.
FEW_WRITE_ROWS = 64


def write_rows(meta: AttentionMetadata) -> torch.Tensor:
    """Where each of the step's new tokens goes, as a row of the layer viewed as ``[num_blocks
    * 2 * block_size, Hk, D]``: K of (block b, slot s) is row ``b * 2 * bs + s``, its V ``bs``
    rows further. The token at position p is on page ``kv_indices[kv_indptr[b] + p // bs]``."""
    bs = meta.block_size
    if meta.num_seqs and len(meta.positions) <= FEW_WRITE_ROWS:  # from the lists: 6 ops fewer
        return torch.tensor(
            [
                s.block_table[p // bs] * 2 * bs + p % bs
                for s in meta.seqs
                for p in range(s.start_pos, s.kv_len)
            ],
            dtype=torch.int64,
        )
    pos = meta.positions
    page_of = meta.kv_indptr.long()[meta.batch_indices.long()] + pos // bs
    return meta.kv_indices.long()[page_of] * (2 * bs) + pos % bs


def write_kv(kv_layer: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the step's new K/V ``[T, Hk, D]`` into the layer's pages at ``write_rows()``
    (rounded to fp8 there when the pages hold fp8)."""
    if row_kernels.write_kv(kv_layer, rows, k, v):  # one call, no index tensors (CPU pages)
        return
    num_blocks, _, bs, hk, d = kv_layer.shape
    k, v = to_kv(k, kv_layer.dtype), to_kv(v, kv_layer.dtype)
    kv_rows = kv_layer.view(num_blocks * 2 * bs, hk, d)
    if kv_layer.element_size() == 1:  # fp8: torch's index_copy_ takes its bytes, not its dtype
        kv_rows, k, v = kv_rows.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kv_rows.index_copy_(0, rows, k)
    kv_rows.index_copy_(0, rows + bs, v)
