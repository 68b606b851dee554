"""The CPU backend with batch invariance off: bf16 pages read in place by the split kernels.

Each prefill attends to its new tokens (``cpu_kernels.attention``, causal) and to its cached
pages (``paged_attention``), the two merged by LSE, and a prefill group's shared pages are
read once for all its members; every decode goes through one ``paged_decode`` call per layer
(cascade groups' shared pages read once, merged in the kernel). Faster than the reference on
long decodes, but a row's rounding depends on where its keys were split, so cached, chunked
and batched answers may differ from cold ones in the last bits (``CpuKernelBackend`` is the
default). Shapes the split kernels lack go to the torch reference.

With a sliding window (``meta.window``; no groups then) a prefill is one causal, windowed
``paged_attention`` call over its pages (its new K/V written first), and the decodes'
``paged_decode`` reads each one's last ``window`` keys: pages before a window are not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_kernels
from .backend import AttentionBackend, AttentionShape, write_kv, write_rows
from .metadata import AttentionMetadata
from .torch_backend import TorchBackend


@dataclass(slots=True)
class _Prefill:
    q_begin: int
    q_end: int
    num_cached: int  # cached keys it attends to on its own (after any group prefix)
    cached_ids: torch.Tensor  # int32 block ids holding them
    group: int | None  # its prefill group, whose shared prefix comes first


@dataclass(slots=True)
class _PrefillGroup:
    q_begin: int
    q_end: int
    shared_ids: torch.Tensor  # int32 block ids of the prefix every member shares


class SplitKernelBackend(AttentionBackend):
    name = "cpu-split"
    supports_window = True

    def __init__(self) -> None:
        self._reference: TorchBackend | None = None  # set by prepare() for shapes we lack
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._prefills: list[_Prefill] = []
        self._groups: list[_PrefillGroup] = []
        self._num_decode_rows = 0
        self._tables = torch.empty(0, 0, dtype=torch.int32)  # decodes' pages
        self._lens = torch.empty(0, dtype=torch.int64)
        self._cascade = torch.empty(0, 3, dtype=torch.int64)  # cascade groups (kernel form)
        self._scale = 1.0
        self._window = 0

    @staticmethod
    def supports(shape: AttentionShape, device: torch.device) -> bool:
        return (
            device.type == "cpu"
            and shape.dtype == shape.page_dtype == torch.bfloat16  # fp8 pages: the reference
            and not shape.softcap  # its prefill and decode kernels have no softcap step
            and shape.head_dim in cpu_kernels.HEAD_DIMS
            and cpu_kernels.load() is not None
        )

    def prepare(self, shape: AttentionShape, device: torch.device) -> None:
        if not self.supports(shape, device):
            self._reference = TorchBackend()
            self._reference.prepare(shape, device)

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        if self._reference is not None:
            self._reference.plan(meta, shape)
            return
        bs = meta.block_size
        self._write_rows = write_rows(meta)
        self._scale = shape.scale
        self._window = meta.window
        qo = meta.qo_indptr.tolist()
        tables = [list(s.block_table) for s in meta.seqs]
        self._groups = []
        group_of: dict[int, tuple[int, int]] = {}  # prefill -> (group, shared blocks)
        for gi, g in enumerate(meta.prefill_groups):
            shared = torch.as_tensor(tables[g.begin][: g.num_shared_blocks], dtype=torch.int32)
            self._groups.append(_PrefillGroup(qo[g.begin], qo[g.end], shared))
            group_of.update({i: (gi, g.num_shared_blocks) for i in range(g.begin, g.end)})
        self._prefills = []
        for i in range(meta.num_prefills):
            start = meta.seqs[i].start_pos
            if self._window:  # all its keys, from the pages: one windowed causal call
                kv_len = meta.seqs[i].kv_len
                ids = torch.as_tensor(tables[i][: -(-kv_len // bs)], dtype=torch.int32)
                self._prefills.append(_Prefill(qo[i], qo[i + 1], kv_len, ids, None))
                continue
            group, n_shared = group_of.get(i, (None, 0))
            own = torch.as_tensor(tables[i][n_shared : -(-start // bs)], dtype=torch.int32)
            self._prefills.append(_Prefill(qo[i], qo[i + 1], start - n_shared * bs, own, group))
        lo = meta.decode_begin
        self._num_decode_rows = qo[-1] - qo[lo]
        if not self._num_decode_rows:
            return
        decodes = meta.seqs[lo:]
        width = max(-(-sq.kv_len // bs) for sq in decodes)
        self._tables = torch.zeros(len(decodes), width, dtype=torch.int32)
        for i, sq in enumerate(decodes):
            own = sq.block_table[: -(-sq.kv_len // bs)]
            self._tables[i, : len(own)] = torch.as_tensor(own, dtype=torch.int32)
        self._lens = torch.tensor([sq.kv_len for sq in decodes], dtype=torch.int64)
        self._cascade = torch.tensor(
            [[g.begin - lo, g.end - lo, g.num_shared_blocks * bs] for g in meta.cascade_groups],
            dtype=torch.int64,
        ).view(-1, 3)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        if self._reference is not None:
            return self._reference.write(k, v, kv_layer)
        write_kv(kv_layer, self._write_rows, k, v)
        return True

    @torch.inference_mode()
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        if self._reference is not None:
            return self._reference.forward(q, k, v, kv_layer)
        bs = kv_layer.shape[2]
        write_kv(kv_layer, self._write_rows, k, v)
        scale, d0 = self._scale, q.shape[0] - self._num_decode_rows
        decoded = None
        if self._num_decode_rows:
            decoded = cpu_kernels.paged_decode(
                q[d0:], kv_layer, self._tables, self._lens, scale, self._cascade, self._window
            )[0]
            if d0 == 0:  # a decode-only step: the kernel's output as is
                return decoded
        out = torch.empty_like(q)
        group_states = [  # each group's shared prefix read once
            cpu_kernels.paged_attention(
                q[g.q_begin : g.q_end], kv_layer, g.shared_ids, g.shared_ids.numel() * bs, scale
            )
            for g in self._groups
        ]
        for p in self._prefills:
            rows = slice(p.q_begin, p.q_end)
            if self._window:
                out[rows] = cpu_kernels.paged_attention(
                    q[rows], kv_layer, p.cached_ids, p.num_cached, scale, True, self._window
                )[0]
                continue
            o, lse = cpu_kernels.attention(q[rows], k[rows], v[rows], scale, True)
            if p.num_cached:
                o_c, lse_c = cpu_kernels.paged_attention(
                    q[rows], kv_layer, p.cached_ids, p.num_cached, scale
                )
                o, lse = cpu_kernels.merge_states(o_c, lse_c, o, lse)
            if p.group is not None:
                o_g, lse_g = group_states[p.group]
                first = p.q_begin - self._groups[p.group].q_begin
                mine = slice(first, first + p.q_end - p.q_begin)
                o, lse = cpu_kernels.merge_states(o_g[mine].contiguous(), lse_g[mine], o, lse)
            out[rows] = o
        if decoded is not None:
            out[d0:] = decoded
        return out
