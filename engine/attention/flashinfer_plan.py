"""The FlashInfer backend's per-step page tables, computed on the host once per step.

FlashInfer's ``plan()`` reads ``qo_indptr``, ``kv_indptr`` and ``kv_last_page_len`` on the host
(it copies them there when given device tensors, a host-device sync), and ``kv_indices`` only
on the device. So the small arrays (``B + 1`` entries) are computed here from the step's
``SeqSpec``s, with numpy, into preallocated host buffers (pinned on CUDA); the page ids stay
on the device: the plain prefill and decode slices are views of ``meta.kv_indices``, and the
cascade levels are one device gather each, at positions computed here. Nothing reads a device
tensor back, and nothing here runs per layer.

Buffers are sized for ``max_num_seqs`` sequences and ``max_num_pages`` page ids and grow only
when a step exceeds them. Two host sets alternate between steps, so the asynchronous copies
FlashInfer enqueues from one step's buffers never race the next step's writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .metadata import AttentionMetadata

_HOST_ARRAYS = ("qo", "kv", "last", "dec_kv", "top_qo", "top_kv", "top_last", "low_qo", "low_kv")


@dataclass(slots=True)
class PageTable:
    """One wrapper's (or one cascade level's) CSR page table, as FlashInfer's ``plan`` takes it."""

    qo_indptr: torch.Tensor  # host int32 [n + 1]
    kv_indptr: torch.Tensor  # host int32 [n + 1]
    kv_indices: torch.Tensor  # device int32 [kv_indptr[-1]]
    last_page_len: torch.Tensor  # host int32 [n]


@dataclass(slots=True)
class StepTables:
    """A step's work split by wrapper; ``rows`` are the query-row ends of each slice."""

    prefill: PageTable | None
    decode: PageTable | None
    cascade: tuple[PageTable, PageTable] | None  # level 0 (shared), level 1 (own pages)
    rows: tuple[int, int, int]  # prefill end, decode end, total rows


class PlanBuffers:
    """Preallocated index buffers: host arrays (numpy views of torch tensors) and device
    page-id buffers for the cascade levels."""

    def __init__(self, device: torch.device, max_num_seqs: int, max_num_pages: int) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self.max_num_seqs = 0
        self.max_num_pages = 0
        self._host: list[dict[str, torch.Tensor]] = []
        self._np: list[dict[str, np.ndarray]] = []
        self._turn = 0
        self._gather_host = [torch.empty(0, dtype=torch.int64)] * 2
        self.gather = torch.empty(0, dtype=torch.int64)
        self.top_indices = torch.empty(0, dtype=torch.int32)
        self.low_indices = torch.empty(0, dtype=torch.int32)
        self.reserve(max_num_seqs, max_num_pages)

    def _alloc(self, n: int, dtype: torch.dtype, host: bool) -> torch.Tensor:
        if host:
            return torch.zeros(n, dtype=dtype, pin_memory=self._pin)
        return torch.zeros(n, dtype=dtype, device=self.device)

    def reserve(self, num_seqs: int, num_pages: int) -> None:
        """Grow (never shrink) to hold a step of ``num_seqs`` sequences and ``num_pages`` ids."""
        if num_seqs > self.max_num_seqs:
            self.max_num_seqs = max(num_seqs, 2 * self.max_num_seqs)
            self._host = [
                {k: self._alloc(self.max_num_seqs + 1, torch.int32, True) for k in _HOST_ARRAYS}
                for _ in range(2)
            ]
            self._np = [{k: t.numpy() for k, t in h.items()} for h in self._host]
            for h in self._np:
                h["low_qo"][:] = np.arange(self.max_num_seqs + 1, dtype=np.int32)
        if num_pages > self.max_num_pages:
            self.max_num_pages = max(num_pages, 2 * self.max_num_pages)
            self._gather_host = [
                self._alloc(2 * self.max_num_pages, torch.int64, True) for _ in range(2)
            ]
            self.gather = self._alloc(2 * self.max_num_pages, torch.int64, False)
            self.top_indices = self._alloc(self.max_num_pages, torch.int32, False)
            self.low_indices = self._alloc(self.max_num_pages, torch.int32, False)

    def next_set(self) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        self._turn ^= 1
        return self._host[self._turn], self._np[self._turn]

    @property
    def gather_host(self) -> torch.Tensor:
        """Host positions of this step's cascade page ids (the set ``next_set`` chose)."""
        return self._gather_host[self._turn]


def _exclusive_cumsum(x: np.ndarray, out: np.ndarray) -> None:
    out[0] = 0
    np.cumsum(x, out=out[1 : len(x) + 1])


def build_tables(meta: AttentionMetadata, bufs: PlanBuffers, use_cascade: bool) -> StepTables:
    """Split the step into prefill, decode and cascade page tables (see module docstring).

    With ``use_cascade`` false, cascade groups are decoded by the decode wrapper like any other
    decode (the batch-invariant and sliding-window cases)."""
    seqs = meta.seqs
    n, bs = len(seqs), meta.block_size
    num_pages = meta.kv_indices.numel()
    bufs.reserve(n, num_pages)
    host, h = bufs.next_set()
    kv_len = np.fromiter((s.kv_len for s in seqs), np.int32, n)
    pages = (kv_len + (bs - 1)) // bs
    _exclusive_cumsum(np.fromiter((s.num_new for s in seqs), np.int32, n), h["qo"])
    _exclusive_cumsum(pages, h["kv"])
    np.subtract(kv_len, (pages - 1) * bs, out=h["last"][:n])
    qo, kv = h["qo"], h["kv"]

    p = meta.num_prefills
    c = meta.cascade_begin if use_cascade and meta.cascade_groups else n
    prefill = decode = None
    if p:
        kp = int(kv[p])
        prefill = PageTable(
            host["qo"][: p + 1], host["kv"][: p + 1], meta.kv_indices[:kp], host["last"][:p]
        )
    if c > p:
        np.subtract(kv[p : c + 1], kv[p], out=h["dec_kv"][: c - p + 1])
        decode = PageTable(
            host["low_qo"][: c - p + 1],
            host["dec_kv"][: c - p + 1],
            meta.kv_indices[int(kv[p]) : int(kv[c])],
            host["last"][p:c],
        )
    cascade = _cascade_tables(meta, bufs, host, h, c) if c < n else None
    return StepTables(prefill, decode, cascade, (int(qo[p]), int(qo[c]), int(qo[n])))


def _cascade_tables(
    meta: AttentionMetadata,
    bufs: PlanBuffers,
    host: dict[str, torch.Tensor],
    h: dict[str, np.ndarray],
    c: int,
) -> tuple[PageTable, PageTable]:
    """Level 0: each group's shared pages (whole pages, non-causal); level 1: each member's
    pages after them, whose last page is the member's own last page."""
    groups = meta.cascade_groups
    n, g, m = meta.num_seqs, len(groups), meta.num_seqs - c
    kv = h["kv"]
    sizes = np.fromiter((x.end - x.begin for x in groups), np.int64, g)
    shared = np.fromiter((x.num_shared_blocks for x in groups), np.int64, g)
    firsts = np.fromiter((kv[x.begin] for x in groups), np.int64, g)
    _exclusive_cumsum(sizes, h["top_qo"])
    _exclusive_cumsum(shared, h["top_kv"])
    h["top_last"][:g] = meta.block_size
    member_shared = np.repeat(shared, sizes)
    starts = kv[c:n].astype(np.int64) + member_shared
    counts = kv[c + 1 : n + 1].astype(np.int64) - starts
    _exclusive_cumsum(counts, h["low_kv"])
    top_total, low_total = int(h["top_kv"][g]), int(h["low_kv"][m])

    # Positions in meta.kv_indices of every level-0 then level-1 page id: one copy, one gather.
    def runs(begins: np.ndarray, lens: np.ndarray, total: int) -> np.ndarray:
        offsets = np.cumsum(lens) - lens
        return np.repeat(begins - offsets, lens) + np.arange(total, dtype=np.int64)

    gh = bufs.gather_host.numpy()
    gh[:top_total] = runs(firsts, shared, top_total)
    gh[top_total : top_total + low_total] = runs(starts, counts, low_total)
    total = top_total + low_total
    gather = bufs.gather[:total]
    gather.copy_(bufs.gather_host[:total], non_blocking=True)
    top = bufs.top_indices[:top_total]
    low = bufs.low_indices[:low_total]
    torch.index_select(meta.kv_indices, 0, gather[:top_total], out=top)
    torch.index_select(meta.kv_indices, 0, gather[top_total:], out=low)
    level0 = PageTable(host["top_qo"][: g + 1], host["top_kv"][: g + 1], top, host["top_last"][:g])
    level1 = PageTable(host["low_qo"][: m + 1], host["low_kv"][: m + 1], low, host["last"][c:n])
    return level0, level1
