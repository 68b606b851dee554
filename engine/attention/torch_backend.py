"""Paged attention in plain torch: the reference backend (any dtype and device; the GPU
fallback, and the CPU one where the engine's kernels do not load).

Same math as FlashInfer (bottom-right causal alignment, base-2 LSE), organised so that no
``[Lq, Lk]`` mask is ever built and no Python loop runs per token:

- prefill of a sequence with ``start`` cached tokens = (queries vs the cached part, no mask)
  merged by LSE with (queries vs the new tokens, causal square);
- plain decodes = one padded gather (whole blocks) + one batched kernel call with a
  key-padding mask;
- a cascade group = the whole group's queries vs the shared prefix in one call (the prefix
  KV is gathered and read once), merged by LSE with each member's suffix (a padded decode);
- a prefill group (prefills after the same cached blocks) works the same way: all members'
  queries vs the shared prefix in one call, merged with each member's own part;
- with a sliding window (``meta.window``, never with groups) a prefill attends to the keys
  of its window only, gathered from the pages (new ones written first), in query chunks with
  a band mask, and a decode's padded gather starts at its window's first block: pages before
  every query's window (maybe the null page) are never read.

New K/V are written through the layer viewed as rows ``[num_blocks * 2 * block_size, Hk, D]``:
K of (block b, slot s) is row ``b*2*bs + s`` and its V is ``bs`` rows further.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import AttentionBackend, AttentionShape, write_kv, write_rows
from .kv_dtype import round_trip
from .metadata import AttentionMetadata, CascadeGroup
from .torch_ops import (
    banded_attention,
    dense_attention,
    grouped_dense_attention,
    merge_states,
    padded_decode_attention,
)

_GATHER_TOKENS = 1 << 18  # padded decode batch gathers at most this many K (and V) rows
_WINDOW_QUERY_CHUNK = 256  # windowed prefill: query rows per banded product


@dataclass(slots=True)
class _PrefillPlan:
    q_begin: int
    q_end: int
    num_cached: int  # cached tokens this sequence attends to on its own (after any group prefix)
    cached_blocks: torch.Tensor  # int64: K page rows (2 * block) of the blocks holding them
    group: int | None = None  # index of its prefill group, whose shared prefix comes first
    window_first: int = 0  # windowed: position of cached_blocks' first key (then it holds
    # every key of the window, the new ones included: they are written first)


@dataclass(slots=True)
class _PrefillGroupPlan:
    q_begin: int
    q_end: int
    shared_blocks: torch.Tensor  # int64 [S]: K page rows of the prefix every member shares


@dataclass(slots=True)
class _DecodePlan:
    """Consecutive decodes over their own pages (a cascade member's: those after the shared
    prefix), in one padded call."""

    q_begin: int
    q_end: int
    blocks: torch.Tensor  # int64 [n, max blocks]: K page rows of each one's own blocks, 0-padded
    lens: torch.Tensor  # int64 [n]: valid tokens in those blocks
    starts: torch.Tensor | None = None  # int64 [n]: windowed, first key in its window


@dataclass(slots=True)
class _CascadePlan:
    """Consecutive cascade groups with the same shared length: their queries attend to their
    shared prefixes in one batched call (a batch entry per group; groups with fewer members
    are padded with copies of a query row, whose outputs are dropped)."""

    q_begin: int
    q_end: int
    num_groups: int
    shared_blocks: torch.Tensor  # int64 [groups * S]: K page rows of each group's prefix
    pad_rows: torch.Tensor | None = None  # int64 [groups * width]: query row of each slot
    valid_rows: torch.Tensor | None = None  # int64 [rows]: the slot of each real query


def _alike_groups(groups: list[CascadeGroup], i: int) -> int:
    """End of the run of groups from ``i`` that one batched call serves: the same shared
    length, and padding to the largest group at most doubles the query rows."""
    j, rows, width = i + 1, groups[i].end - groups[i].begin, groups[i].end - groups[i].begin
    while j < len(groups) and groups[j].num_shared_blocks == groups[i].num_shared_blocks:
        n = groups[j].end - groups[j].begin
        if (j - i + 1) * max(width, n) > 2 * (rows + n):
            break
        rows, width, j = rows + n, max(width, n), j + 1
    return j


def _decode_chunks(kv_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split consecutive decodes so that one padded gather stays under _GATHER_TOKENS."""
    chunks: list[tuple[int, int]] = []
    begin, width = 0, 0
    for i, n in enumerate(kv_lens):
        w = max(width, -(-n // block_size) * block_size)
        if i > begin and (i - begin + 1) * w > _GATHER_TOKENS:
            chunks.append((begin, i))
            begin, w = i, -(-n // block_size) * block_size
        width = w
    if kv_lens:
        chunks.append((begin, len(kv_lens)))
    return chunks


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """The tables as one ``[n, longest]`` tensor, each padded with its own last block (its
    rows are masked; block 0 may be a sliding layer's null page, whose junk could overflow)."""
    out = torch.zeros(len(tables), max(1, max(len(t) for t in tables)), dtype=torch.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
        out[i, len(t) :] = t[-1] if t else 0
    return out


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_window = True

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._shape: AttentionShape | None = None
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._prefills: list[_PrefillPlan] = []
        self._prefill_groups: list[_PrefillGroupPlan] = []
        self._decodes: list[_DecodePlan] = []
        self._cascades: list[_CascadePlan] = []
        self._num_decode_rows = 0
        self._window = 0
        # Gather buffers, reused across layers and steps: fresh multi-MB allocations on CPU
        # cost more in page faults than the copy itself.
        self._scratch: dict[str, torch.Tensor] = {}
        self._compute_dtype = torch.float32  # q's, set by forward

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        bs = meta.block_size
        dev = meta.positions.device
        tables = [list(s.block_table) for s in meta.seqs]
        qo = meta.qo_indptr.tolist()

        self._write_rows = write_rows(meta)
        self._prefill_groups = []
        group_of: dict[int, tuple[int, int]] = {}  # prefill index -> (group, shared blocks)
        for gi, g in enumerate(meta.prefill_groups):
            shared = torch.as_tensor(tables[g.begin][: g.num_shared_blocks], dtype=torch.int64)
            self._prefill_groups.append(
                _PrefillGroupPlan(qo[g.begin], qo[g.end], (shared * 2).to(dev))
            )
            group_of.update({i: (gi, g.num_shared_blocks) for i in range(g.begin, g.end)})
        self._prefills = []
        window = self._window = meta.window
        for i in range(meta.num_prefills):
            start = meta.seqs[i].start_pos
            if window:  # blocks from the first query's window on, through the new tokens
                first = max(0, start - window + 1) // bs
                own = tables[i][first : -(-meta.seqs[i].kv_len // bs)]
                blocks = (torch.as_tensor(own, dtype=torch.int64) * 2).to(dev)
                self._prefills.append(
                    _PrefillPlan(qo[i], qo[i + 1], start, blocks, None, first * bs)
                )
                continue
            group, n_shared = group_of.get(i, (None, 0))
            own = tables[i][n_shared : -(-start // bs)]
            blocks = (torch.as_tensor(own, dtype=torch.int64) * 2).to(dev)
            self._prefills.append(
                _PrefillPlan(qo[i], qo[i + 1], start - n_shared * bs, blocks, group)
            )

        lo = meta.decode_begin
        self._decodes, self._cascades = [], []
        self._num_decode_rows = qo[-1] - qo[lo]
        self._meta, self._shape = meta, shape
        # Own pages of every decode (plain ones: all of them; cascade members: after the
        # group's shared blocks), then the groups' shared prefixes, batched where alike.
        shared_of = [0] * (meta.num_seqs - lo)
        for g in meta.cascade_groups:
            shared_of[g.begin - lo : g.end - lo] = [g.num_shared_blocks] * (g.end - g.begin)
        if window:  # a decode's own blocks start at its window's first block
            shared_of = [max(0, s.kv_len - window) // bs for s in meta.seqs[lo:]]
        own_lens = [s.kv_len - n * bs for s, n in zip(meta.seqs[lo:], shared_of, strict=True)]
        self._decodes = []
        for a, b in _decode_chunks(own_lens, bs):
            own = [
                tables[lo + i][shared_of[i] : -(-meta.seqs[lo + i].kv_len // bs)]
                for i in range(a, b)
            ]
            lens = torch.tensor(own_lens[a:b], dtype=torch.int64)
            plan = _DecodePlan(qo[lo + a], qo[lo + b], (_padded(own) * 2).to(dev), lens.to(dev))
            if window:
                plan.starts = (lens - window).clamp_(min=0).to(dev)
            self._decodes.append(plan)
        self._cascades = []
        groups = meta.cascade_groups
        i = 0
        while i < len(groups):
            j = _alike_groups(groups, i)
            run = groups[i:j]
            shared = [b for h in run for b in tables[h.begin][: h.num_shared_blocks]]
            plan = _CascadePlan(
                qo[run[0].begin],
                qo[run[-1].end],
                j - i,
                (torch.as_tensor(shared, dtype=torch.int64) * 2).to(dev),
            )
            sizes = [h.end - h.begin for h in run]
            width = max(sizes)
            if min(sizes) < width:  # pad each group's queries to `width` rows
                pad, valid, row = [], [], 0
                for gi, n in enumerate(sizes):
                    pad += list(range(row, row + n)) + [row] * (width - n)
                    valid += range(gi * width, gi * width + n)
                    row += n
                plan.pad_rows = torch.tensor(pad, dtype=torch.int64, device=dev)
                plan.valid_rows = torch.tensor(valid, dtype=torch.int64, device=dev)
            self._cascades.append(plan)
            i = j

    def _gather(
        self, kv_layer: torch.Tensor, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, ``[len(blocks) * bs, Hk, D]`` each (scratch memory; fp8
        pages converted to the compute dtype, exactly).

        ``blocks`` holds K page rows (``2 * block``) of the layer viewed as one contiguous row
        per (block, K|V) page: whole-row copies, much faster than gathering a strided view."""
        num_blocks, _, bs, hk, d = kv_layer.shape
        pages = kv_layer.view(num_blocks * 2, bs * hk * d)
        if kv_layer.element_size() == 1:  # fp8: index_select takes its bytes, not its dtype
            pages = pages.view(torch.uint8)
        n = blocks.numel()
        out = []
        for j, name in enumerate(("k", "v")):
            buf = self._scratch.get(name)
            if buf is None or buf.numel() < n * bs * hk * d or buf.dtype != pages.dtype:
                buf = torch.empty(n * bs * hk * d, dtype=pages.dtype, device=kv_layer.device)
                self._scratch[name] = buf
            view = buf[: n * bs * hk * d].view(n, bs * hk * d)
            torch.index_select(pages, 0, blocks + j if j else blocks, out=view)
            out.append(view.view(kv_layer.dtype).view(n * bs, hk, d).to(self._compute_dtype))
        return out[0], out[1]

    def _window_prefill(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        p: _PrefillPlan,
        scale: float,
        softcap: float,
    ) -> torch.Tensor:
        """A prefill's rows over the keys of their windows (``p.cached_blocks``, gathered)."""
        w, start, first = self._window, p.num_cached, p.window_first
        keys_k, keys_v = self._gather(kv_layer, p.cached_blocks)
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], _WINDOW_QUERY_CHUNK):
            b = min(q.shape[0], a + _WINDOW_QUERY_CHUNK)
            lo, hi = max(first, start + a - w + 1) - first, start + b - first
            out[a:b] = banded_attention(
                q[a:b], keys_k[lo:hi], keys_v[lo:hi], scale, start + a, first + lo, w, softcap
            )
        return out

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        write_kv(kv_layer, self._write_rows, k, v)
        return True

    @torch.inference_mode()
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        assert self._meta is not None and self._shape is not None, "plan() first"
        bs = self._meta.block_size
        scale, softcap = self._shape.scale, self._shape.softcap
        hk, d = kv_layer.shape[3:]
        write_kv(kv_layer, self._write_rows, k, v)
        # The new tokens attend to their own K/V as the pages hold them (fp8: rounded), as a
        # later request that finds them cached will.
        k, v = round_trip(k, kv_layer.dtype), round_trip(v, kv_layer.dtype)
        self._compute_dtype = q.dtype
        out = torch.empty_like(q)
        group_states = []
        for gp in self._prefill_groups:  # the shared prefix is read once
            qg = q[gp.q_begin : gp.q_end]
            sk, sv = self._gather(kv_layer, gp.shared_blocks)
            group_states.append(dense_attention(qg, sk, sv, scale, False, softcap))
        for p in self._prefills:
            qs = q[p.q_begin : p.q_end]
            if self._window:
                out[p.q_begin : p.q_end] = self._window_prefill(qs, kv_layer, p, scale, softcap)
                continue
            o, lse = dense_attention(
                qs, k[p.q_begin : p.q_end], v[p.q_begin : p.q_end], scale, True, softcap
            )
            if p.num_cached:
                ck, cv = self._gather(kv_layer, p.cached_blocks)
                o_c, lse_c = dense_attention(
                    qs, ck[: p.num_cached], cv[: p.num_cached], scale, False, softcap
                )
                o, lse = merge_states(o_c, lse_c, o, lse)
            if p.group is not None:
                o_g, lse_g = group_states[p.group]
                first = p.q_begin - self._prefill_groups[p.group].q_begin
                rows = slice(first, first + p.q_end - p.q_begin)
                o, lse = merge_states(o_g[rows], lse_g[rows], o, lse)
            out[p.q_begin : p.q_end] = o
        if not self._decodes:
            return out
        d0 = self._decodes[0].q_begin
        own_lse = q.new_empty(self._num_decode_rows, q.shape[1], dtype=torch.float32)
        for dp in self._decodes:
            n, width = dp.blocks.shape
            ok, ov = self._gather(kv_layer, dp.blocks.reshape(-1))
            o, lse = padded_decode_attention(
                q[dp.q_begin : dp.q_end],
                ok.view(n, width * bs, hk, d),
                ov.view(n, width * bs, hk, d),
                dp.lens,
                scale,
                dp.starts,
                softcap,
            )
            out[dp.q_begin : dp.q_end] = o
            own_lse[dp.q_begin - d0 : dp.q_end - d0] = lse
        for cp in self._cascades:
            rows = slice(cp.q_begin, cp.q_end)
            sk, sv = self._gather(kv_layer, cp.shared_blocks)  # each prefix read once
            qs = q[rows] if cp.pad_rows is None else q[rows].index_select(0, cp.pad_rows)
            o_s, lse_s = grouped_dense_attention(qs, sk, sv, cp.num_groups, scale, softcap)
            if cp.valid_rows is not None:
                o_s, lse_s = (
                    o_s.index_select(0, cp.valid_rows),
                    lse_s.index_select(0, cp.valid_rows),
                )
            own = slice(cp.q_begin - d0, cp.q_end - d0)
            out[rows], _ = merge_states(o_s, lse_s, out[rows], own_lse[own])
        return out
