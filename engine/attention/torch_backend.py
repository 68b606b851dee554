"""Paged attention in plain torch: the CPU backend and the GPU fallback.

Same math as FlashInfer (bottom-right causal alignment, base-2 LSE), organised so that no
``[Lq, Lk]`` mask is ever built and no Python loop runs per token:

- prefill of a sequence with ``start`` cached tokens = (queries vs the cached part, no mask)
  merged by LSE with (queries vs the new tokens, causal square);
- plain decodes = one padded gather (whole blocks) + one batched kernel call with a
  key-padding mask;
- a cascade group = the whole group's queries vs the shared prefix in one call (the prefix
  KV is gathered and read once), merged by LSE with each member's suffix (a padded decode);
- a prefill group (prefills after the same cached blocks) works the same way: all members'
  queries vs the shared prefix in one call, merged with each member's own part.

New K/V are written through the layer viewed as rows ``[num_blocks * 2 * block_size, Hk, D]``:
K of (block b, slot s) is row ``b*2*bs + s`` and its V is ``bs`` rows further.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import torch_private
from . import cpu_kernels
from .backend import AttentionBackend, AttentionShape
from .metadata import AttentionMetadata, CascadeGroup

LOG2E = 1.0 / math.log(2.0)
_QUERY_CHUNK = 1024  # query rows per product in the generic (non-CPU) path
_GATHER_TOKENS = 1 << 18  # padded decode batch gathers at most this many K (and V) rows


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets (LSEs in base 2).

    ``o_*`` ``[N, H, D]``, ``lse_*`` float32 ``[N, H]``. Two empty states (-inf) merge to 0.
    """
    if cpu_kernels.merges(o_a, o_b):
        return cpu_kernels.merge_states(o_a, lse_a, o_b, lse_b)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a = torch.exp2(lse_a - m)
    w_b = torch.exp2(lse_b - m)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    o = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / denom[..., None]
    return o.to(o_a.dtype), m + torch.log2(total)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[Lq, Hq, D]`` over contiguous ``k``/``v`` ``[Lk, Hk, D]``.

    ``causal`` requires ``Lq == Lk`` (the square of new tokens). Returns the output
    ``[Lq, Hq, D]`` (q's dtype) and the base-2 LSE ``[Lq, Hq]`` (float32).
    """
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    if lk == 0:
        return q.new_zeros(q.shape), q.new_full((lq, hq), -math.inf, dtype=torch.float32)
    if q.device.type == "cpu":
        if cpu_kernels.supports(q, k, v):
            return cpu_kernels.attention(q, k, v, scale, causal)
        if causal:
            assert lq == lk
            if g > 1:
                k = k.repeat_interleave(g, dim=1)
                v = v.repeat_interleave(g, dim=1)
            qh, kh, vh = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
            o, lse = torch_private.flash_attention_cpu(qh, kh, vh, True, scale)
            return o[0].permute(1, 0, 2), lse[0].transpose(0, 1) * LOG2E
        # Non-causal: fold the g query heads of a kv head into the row axis, so K/V are not
        # expanded and are read once per kv head.
        qh = q.view(lq, hk, g, d).permute(1, 2, 0, 3).reshape(1, hk, g * lq, d)
        kh, vh = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
        o, lse = torch_private.flash_attention_cpu(qh, kh, vh, False, scale)
        o = o.view(hk, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)
        lse = lse.view(hk, g, lq).permute(2, 0, 1).reshape(lq, hq) * LOG2E
        return o, lse
    return _dense_attention_generic(q, k, v, scale, causal)


def grouped_dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_groups`` equal groups of queries, each over its own keys, no mask.

    ``q`` ``[G * n, Hq, D]`` (group-major), ``k``/``v`` ``[G * L, Hk, D]``. Returns the output
    ``[G * n, Hq, D]`` and base-2 LSE ``[G * n, Hq]`` (float32), as ``dense_attention`` would
    per group."""
    if num_groups == 1 or q.device.type != "cpu":
        states = [
            dense_attention(qg, kg, vg, scale, causal=False)
            for qg, kg, vg in zip(
                q.chunk(num_groups), k.chunk(num_groups), v.chunk(num_groups), strict=True
            )
        ]
        return torch.cat([o for o, _ in states]), torch.cat([lse for _, lse in states])
    rows, hq, d = q.shape
    hk = k.shape[1]
    g, n, length = hq // hk, rows // num_groups, k.shape[0] // num_groups
    # Fold each kv head's g query heads and the group's n queries into rows: K/V read once.
    qh = q.view(num_groups, n, hk, g, d).permute(0, 2, 3, 1, 4).reshape(num_groups, hk, g * n, d)
    kh = k.view(num_groups, length, hk, d).permute(0, 2, 1, 3)
    vh = v.view(num_groups, length, hk, d).permute(0, 2, 1, 3)
    o, lse = torch_private.flash_attention_cpu(qh, kh, vh, False, scale)
    o = o.view(num_groups, hk, g, n, d).permute(0, 3, 1, 2, 4).reshape(rows, hq, d)
    lse = lse.view(num_groups, hk, g, n).permute(0, 3, 1, 2).reshape(rows, hq) * LOG2E
    return o, lse


def _dense_attention_generic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    kf = k.float().permute(1, 2, 0)  # [Hk, D, Lk]
    vf = v.float().permute(1, 0, 2)  # [Hk, Lk, D]
    out = torch.empty(lq, hq, d, dtype=q.dtype, device=q.device)
    lse_out = torch.empty(lq, hq, dtype=torch.float32, device=q.device)
    for a in range(0, lq, _QUERY_CHUNK):
        b = min(lq, a + _QUERY_CHUNK)
        qc = q[a:b].float().view(b - a, hk, g, d).permute(1, 2, 0, 3)  # [Hk, g, n, D]
        s = torch.matmul(qc.reshape(hk, g * (b - a), d), kf).view(hk, g, b - a, lk) * scale
        if causal:
            rows = torch.arange(a, b, device=q.device)[:, None]
            cols = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(cols > rows + (lk - lq), -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # [Hk, g, n]
        p = torch.exp(s - lse[..., None])
        o = torch.matmul(p.view(hk, g * (b - a), lk), vf).view(hk, g, b - a, d)
        out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, hq, d).to(q.dtype)
        lse_out[a:b] = lse.permute(2, 0, 1).reshape(b - a, hq) * LOG2E
    return out, lse_out


def padded_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its own keys, batched with padding.

    ``q`` ``[B, Hq, D]``; ``k``/``v`` ``[B, L, Hk, D]`` (rows past ``lens[b]`` are padding).
    Returns ``o`` ``[B, Hq, D]`` and the base-2 LSE ``[B, Hq]`` (float32).
    """
    b, hq, d = q.shape
    length, hk = k.shape[1], k.shape[2]
    g = hq // hk
    pad = torch.arange(length, device=q.device)[None, :] >= lens[:, None]  # [B, L]
    qh = q.view(b, hk, g, d)
    kh, vh = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [B, Hk, L, D] views
    if q.device.type == "cpu":
        mask = torch.zeros(b, 1, 1, length, dtype=q.dtype).masked_fill_(
            pad[:, None, None, :], -math.inf
        )
        o, lse = torch_private.flash_attention_cpu(qh, kh, vh, False, scale, attn_mask=mask)
        return o.reshape(b, hq, d), lse.reshape(b, hq) * LOG2E
    return _padded_decode_generic(qh, kh, vh, pad, scale)


def _padded_decode_generic(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, pad: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hk, g, d = qh.shape
    hq = hk * g
    s = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * scale  # [B, Hk, g, L]
    s.masked_fill_(pad[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse[..., None]), vh.float())
    return o.reshape(b, hq, d).to(qh.dtype), lse.reshape(b, hq) * LOG2E


@dataclass(slots=True)
class _PrefillPlan:
    q_begin: int
    q_end: int
    num_cached: int  # cached tokens this sequence attends to on its own (after any group prefix)
    cached_blocks: torch.Tensor  # int64: K page rows (2 * block) of the blocks holding them
    group: int | None = None  # index of its prefill group, whose shared prefix comes first
    cached_ids: torch.Tensor | None = None  # int32 block ids, where the CPU kernel reads pages


@dataclass(slots=True)
class _PrefillGroupPlan:
    q_begin: int
    q_end: int
    shared_blocks: torch.Tensor  # int64 [S]: K page rows of the prefix every member shares
    shared_ids: torch.Tensor | None = None  # int32 block ids, where the CPU kernel reads pages


@dataclass(slots=True)
class _DecodePlan:
    """Consecutive decodes over their own pages (a cascade member's: those after the shared
    prefix), in one padded call."""

    q_begin: int
    q_end: int
    blocks: torch.Tensor  # int64 [n, max blocks]: K page rows of each one's own blocks, 0-padded
    lens: torch.Tensor  # int64 [n]: valid tokens in those blocks


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
    out = torch.zeros(len(tables), max(1, max(len(t) for t in tables)), dtype=torch.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
    return out


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._shape: AttentionShape | None = None
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._prefills: list[_PrefillPlan] = []
        self._prefill_groups: list[_PrefillGroupPlan] = []
        self._decodes: list[_DecodePlan] = []
        self._cascades: list[_CascadePlan] = []
        self._num_decode_rows = 0
        # CPU bf16 with the engine's kernel: every decode reads its pages in place, one call.
        self._paged_tables: torch.Tensor | None = None  # int32 [decodes, max blocks]
        self._paged_lens = torch.empty(0, dtype=torch.int64)
        self._paged_groups = torch.empty(0, 3, dtype=torch.int64)  # cascade groups (kernel form)
        # Gather buffers, reused across layers and steps: fresh multi-MB allocations on CPU
        # cost more in page faults than the copy itself.
        self._scratch: dict[str, torch.Tensor] = {}

    def prepare(self, shape: AttentionShape, device: torch.device) -> None:
        bf16_cpu = device.type == "cpu" and shape.dtype == torch.bfloat16
        if bf16_cpu and shape.head_dim in cpu_kernels.HEAD_DIMS:
            cpu_kernels.load()  # compiled on first use, about 2 s: not during a request

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        bs = meta.block_size
        dev = meta.positions.device
        tables = [list(s.block_table) for s in meta.seqs]
        qo = meta.qo_indptr.tolist()

        # Slot of every new token: page kv_indices[kv_indptr[b] + pos // bs], offset pos % bs.
        pos = meta.positions
        page_of = meta.kv_indptr.long()[meta.batch_indices.long()] + pos // bs
        self._write_rows = meta.kv_indices.long()[page_of] * (2 * bs) + pos % bs

        in_place = self._reads_pages_in_place(shape, dev)
        self._prefill_groups = []
        group_of: dict[int, tuple[int, int]] = {}  # prefill index -> (group, shared blocks)
        for gi, g in enumerate(meta.prefill_groups):
            shared = torch.as_tensor(tables[g.begin][: g.num_shared_blocks], dtype=torch.int64)
            ids = shared.to(torch.int32) if in_place else None
            self._prefill_groups.append(
                _PrefillGroupPlan(qo[g.begin], qo[g.end], (shared * 2).to(dev), ids)
            )
            group_of.update({i: (gi, g.num_shared_blocks) for i in range(g.begin, g.end)})
        self._prefills = []
        for i in range(meta.num_prefills):
            start = meta.seqs[i].start_pos
            group, n_shared = group_of.get(i, (None, 0))
            own = tables[i][n_shared : -(-start // bs)]
            blocks = (torch.as_tensor(own, dtype=torch.int64) * 2).to(dev)
            plan = _PrefillPlan(qo[i], qo[i + 1], start - n_shared * bs, blocks, group)
            if in_place:
                plan.cached_ids = torch.as_tensor(own, dtype=torch.int32)
            self._prefills.append(plan)

        lo = meta.decode_begin
        self._paged_tables = None
        self._decodes, self._cascades = [], []
        self._num_decode_rows = qo[-1] - qo[lo]
        self._meta, self._shape = meta, shape
        if self._num_decode_rows and in_place:
            # One kernel call per layer: every decode reads its pages in place, and each
            # cascade group's shared prefix is read once for all its members' queries.
            decodes = meta.seqs[lo:]
            width = max(-(-sq.kv_len // bs) for sq in decodes)
            table = torch.zeros(len(decodes), width, dtype=torch.int32)
            for i, sq in enumerate(decodes):
                own = sq.block_table[: -(-sq.kv_len // bs)]
                table[i, : len(own)] = torch.as_tensor(own, dtype=torch.int32)
            self._paged_tables = table
            self._paged_lens = torch.tensor([sq.kv_len for sq in decodes], dtype=torch.int64)
            self._paged_groups = torch.tensor(
                [[g.begin - lo, g.end - lo, g.num_shared_blocks * bs] for g in meta.cascade_groups],
                dtype=torch.int64,
            ).view(-1, 3)
            return
        # Own pages of every decode (plain ones: all of them; cascade members: after the
        # group's shared blocks), then the groups' shared prefixes, batched where alike.
        shared_of = [0] * (meta.num_seqs - lo)
        for g in meta.cascade_groups:
            shared_of[g.begin - lo : g.end - lo] = [g.num_shared_blocks] * (g.end - g.begin)
        own_lens = [s.kv_len - n * bs for s, n in zip(meta.seqs[lo:], shared_of, strict=True)]
        self._decodes = []
        for a, b in _decode_chunks(own_lens, bs):
            own = [
                tables[lo + i][shared_of[i] : -(-meta.seqs[lo + i].kv_len // bs)]
                for i in range(a, b)
            ]
            lens = torch.tensor(own_lens[a:b], dtype=torch.int64)
            self._decodes.append(
                _DecodePlan(qo[lo + a], qo[lo + b], (_padded(own) * 2).to(dev), lens.to(dev))
            )
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

    @staticmethod
    def _reads_pages_in_place(shape: AttentionShape, device: torch.device) -> bool:
        return (
            device.type == "cpu"
            and shape.dtype == torch.bfloat16
            and shape.head_dim in cpu_kernels.HEAD_DIMS
            and cpu_kernels.load() is not None
        )

    def _gather(
        self, kv_layer: torch.Tensor, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, ``[len(blocks) * bs, Hk, D]`` each (scratch memory).

        ``blocks`` holds K page rows (``2 * block``) of the layer viewed as one contiguous row
        per (block, K|V) page: whole-row copies, much faster than gathering a strided view."""
        num_blocks, _, bs, hk, d = kv_layer.shape
        pages = kv_layer.view(num_blocks * 2, bs * hk * d)
        n = blocks.numel()
        out = []
        for j, name in enumerate(("k", "v")):
            buf = self._scratch.get(name)
            if buf is None or buf.numel() < n * bs * hk * d or buf.dtype != kv_layer.dtype:
                buf = torch.empty(n * bs * hk * d, dtype=kv_layer.dtype, device=kv_layer.device)
                self._scratch[name] = buf
            view = buf[: n * bs * hk * d].view(n, bs * hk * d)
            torch.index_select(pages, 0, blocks + j if j else blocks, out=view)
            out.append(view.view(n * bs, hk, d))
        return out[0], out[1]

    @torch.inference_mode()
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        assert self._meta is not None and self._shape is not None, "plan() first"
        bs = self._meta.block_size
        scale = self._shape.scale
        num_blocks, _, _, hk, d = kv_layer.shape
        kv_rows = kv_layer.view(num_blocks * 2 * bs, hk, d)
        kv_rows.index_copy_(0, self._write_rows, k.to(kv_layer.dtype))
        kv_rows.index_copy_(0, self._write_rows + bs, v.to(kv_layer.dtype))
        decoded = None  # every decode in one kernel call, reading its pages in place
        if self._paged_tables is not None:
            d0 = q.shape[0] - self._num_decode_rows
            decoded = cpu_kernels.paged_decode(
                q[d0:], kv_layer, self._paged_tables, self._paged_lens, scale, self._paged_groups
            )[0]
            if d0 == 0:  # a decode-only step: the kernel's output as is
                return decoded

        out = torch.empty_like(q)
        group_states = []
        for gp in self._prefill_groups:  # the shared prefix is read once
            qg = q[gp.q_begin : gp.q_end]
            if gp.shared_ids is not None:
                n = gp.shared_ids.numel() * bs
                group_states.append(
                    cpu_kernels.paged_attention(qg, kv_layer, gp.shared_ids, n, scale)
                )
                continue
            sk, sv = self._gather(kv_layer, gp.shared_blocks)
            group_states.append(dense_attention(qg, sk, sv, scale, False))
        for p in self._prefills:
            qs = q[p.q_begin : p.q_end]
            o, lse = dense_attention(
                qs, k[p.q_begin : p.q_end], v[p.q_begin : p.q_end], scale, causal=True
            )
            if p.num_cached and p.cached_ids is not None:
                o_c, lse_c = cpu_kernels.paged_attention(
                    qs, kv_layer, p.cached_ids, p.num_cached, scale
                )
                o, lse = merge_states(o_c, lse_c, o, lse)
            elif p.num_cached:
                ck, cv = self._gather(kv_layer, p.cached_blocks)
                o_c, lse_c = dense_attention(
                    qs, ck[: p.num_cached], cv[: p.num_cached], scale, causal=False
                )
                o, lse = merge_states(o_c, lse_c, o, lse)
            if p.group is not None:
                o_g, lse_g = group_states[p.group]
                first = p.q_begin - self._prefill_groups[p.group].q_begin
                rows = slice(first, first + p.q_end - p.q_begin)
                o, lse = merge_states(o_g[rows], lse_g[rows], o, lse)
            out[p.q_begin : p.q_end] = o
        if decoded is not None:
            out[q.shape[0] - decoded.shape[0] :] = decoded
            return out
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
            )
            out[dp.q_begin : dp.q_end] = o
            own_lse[dp.q_begin - d0 : dp.q_end - d0] = lse
        for cp in self._cascades:
            rows = slice(cp.q_begin, cp.q_end)
            sk, sv = self._gather(kv_layer, cp.shared_blocks)  # each prefix read once
            qs = q[rows] if cp.pad_rows is None else q[rows].index_select(0, cp.pad_rows)
            o_s, lse_s = grouped_dense_attention(qs, sk, sv, cp.num_groups, scale)
            if cp.valid_rows is not None:
                o_s, lse_s = (
                    o_s.index_select(0, cp.valid_rows),
                    lse_s.index_select(0, cp.valid_rows),
                )
            own = slice(cp.q_begin - d0, cp.q_end - d0)
            out[rows], _ = merge_states(o_s, lse_s, out[rows], own_lse[own])
        return out
