"""A small paged attention with sliding windows, for the hybrid-model tests (until the
sliding-window kernels land): per sequence, the keys it may see, gathered from its pages, one
masked softmax. Reads only keys inside the window (the null page is never touched)."""

from __future__ import annotations

import torch

from prefixcache.engine.attention import AttentionBackend, AttentionMetadata, AttentionShape
from prefixcache.engine.attention.backend import write_kv, write_rows


class WindowedReferenceBackend(AttentionBackend):
    name = "windowed-reference"
    supports_window = True

    def __init__(self) -> None:
        self.meta: AttentionMetadata | None = None
        self.shape: AttentionShape | None = None
        self.plans: list[AttentionMetadata] = []

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        self.meta, self.shape = meta, shape
        self.plans.append(meta)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        meta, shape = self.meta, self.shape
        assert meta is not None and shape is not None
        write_kv(kv_layer, write_rows(meta), k, v)
        bs, w = meta.block_size, meta.window
        out = torch.empty_like(q)
        qo, kvp = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        pages = meta.kv_indices.tolist()
        group = shape.num_heads // shape.num_kv_heads
        for b, seq in enumerate(meta.seqs):
            start, end = seq.start_pos, seq.kv_len
            lo = max(0, start - w + 1) if w else 0  # the first key any of its queries sees
            first, last = lo // bs, (end - 1) // bs
            table = pages[kvp[b] + first : kvp[b] + last + 1]
            kv = kv_layer[torch.tensor(table, dtype=torch.long)]  # [n, 2, bs, Hk, D]
            keys = kv[:, 0].reshape(-1, *kv.shape[3:])[lo - first * bs : end - first * bs]
            vals = kv[:, 1].reshape(-1, *kv.shape[3:])[lo - first * bs : end - first * bs]
            keys = keys.float().repeat_interleave(group, dim=1)  # [K, Hq, D]
            vals = vals.float().repeat_interleave(group, dim=1)
            qs = q[qo[b] : qo[b + 1]].float()  # [Q, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", qs, keys) * shape.scale
            qpos = torch.arange(start, end).view(-1, 1)
            kpos = torch.arange(lo, end).view(1, -1)
            mask = kpos <= qpos
            if w:
                mask &= kpos > qpos - w
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
        return out
