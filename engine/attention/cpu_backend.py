"""The CPU backend on the engine's own kernel: batch-invariant paged attention.

Every query row of a step (prefill chunks, rows after cached pages, decodes, members of a
cascade or prefill group) goes through one kernel call per layer, ``row_kernels.
row_attention``, which reads the K/V pages in place and gives each row the same arithmetic
whatever shares the step: fixed key blocks at absolute positions, one online-softmax order,
one bf16 rounding at the end. So a position's attention output depends only on the tokens up
to it, not on how much came from the cache, where chunked prefill cut or who shares the step.

bf16 and fp32 pools run on it, and fp8 pages under either (read through exactly); shapes it lacks (fp16 pools, other head dims) and CPUs
without AVX512_BF16 go to the torch reference backend, which computes the same math
without that guarantee.
"""

from __future__ import annotations

import torch

from ..kernels.cpu_replay import KernelCall, Reg
from . import cpu_kernels, row_kernels
from .backend import AttentionBackend, AttentionShape, write_kv, write_rows
from .kv_dtype import is_fp8
from .metadata import AttentionMetadata
from .torch_backend import TorchBackend

# A recorded layer's registers: the row plan's, then write_kv's rows (``step_registers``).
NUM_REGISTERS = len(row_kernels.ROW_PLAN_REGS) + 1


class CpuKernelBackend(AttentionBackend):
    name = "cpu"
    supports_window = True

    def __init__(self) -> None:
        self._reference: TorchBackend | None = None  # set by prepare() for shapes we lack
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._scale, self._softcap = 1.0, 0.0
        self._rows = row_kernels.plan_rows(  # the step's tables, set by plan()
            torch.empty(0, 0, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64),
        )
        self._kept = self._rows  # kept_registers()' plan, held while a program reads it

    @staticmethod
    def supports(shape: AttentionShape, device: torch.device) -> bool:
        return (
            device.type == "cpu"
            and shape.dtype in cpu_kernels.ROW_DTYPES
            and (shape.page_dtype == shape.dtype or is_fp8(shape.page_dtype))
            and shape.head_dim in cpu_kernels.HEAD_DIMS
            and row_kernels.load_rows(shape.dtype) is not None
        )

    @property
    def batch_invariant(self) -> bool:
        """Whether this backend's rows are batch-invariant (False once it fell back)."""
        return self._reference is None

    def prepare(self, shape: AttentionShape, device: torch.device) -> None:
        self._scale, self._softcap = shape.scale, shape.softcap
        if not self.supports(shape, device):
            self._reference = TorchBackend()
            self._reference.prepare(shape, device)

    def plan(self, meta: AttentionMetadata, shape: AttentionShape) -> None:
        if self._reference is not None:
            self._reference.plan(meta, shape)
            return
        bs = meta.block_size
        self._write_rows = write_rows(meta)
        # Built from the sequences' lists, one tensor each: a decode step's few ints cost
        # more as tensor ops (about 15 of them) than the kernels' own setup.
        seqs = meta.seqs
        pages = [-(-s.kv_len // bs) for s in seqs]  # meta.kv_indices' pages of each
        width = max(pages, default=1)
        flat: list[int] = []
        for s, n in zip(seqs, pages, strict=True):  # one padded row per sequence
            flat += s.block_table[:n]
            flat += [0] * (width - n)
        groups = sorted(
            [*meta.prefill_groups, *meta.cascade_groups], key=lambda g: g.begin
        )  # disjoint: prefill groups hold prefills, cascade groups decodes
        self._rows = row_kernels.plan_rows(
            torch.tensor(flat, dtype=torch.int32).view(len(seqs), width),
            meta.qo_indptr.long(),
            torch.tensor([s.kv_len for s in seqs], dtype=torch.int64),
            torch.tensor(
                [[g.begin, g.end, g.num_shared_blocks * bs] for g in groups], dtype=torch.int64
            ).view(-1, 3)
            if groups
            else cpu_kernels.NO_GROUPS,
            meta.window,  # no groups then (AttentionMetadata.build)
        )

    def record_layer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        out: torch.Tensor,
        first_register: int = 0,
    ) -> list[KernelCall] | None:
        """``forward``'s kernel calls into ``out``, their per-step values left to the registers
        ``step_registers()`` fills (``NUM_REGISTERS`` of them from ``first_register``: a
        hybrid model's two backends use two ranges), for a recorded step; None where this
        backend cannot (it fell back to the reference, or the row kernel's write does not
        take these pages)."""
        if self._reference is not None:
            return None
        regs = [Reg(first_register + i) for i in range(NUM_REGISTERS)]
        write = row_kernels.write_kv_call(kv_layer, regs[-1], k, v)
        if write is None:
            return None
        return [write, self.record_attend(q, kv_layer, out, first_register)]

    def record_attend(
        self, q: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor, first_register: int = 0
    ) -> KernelCall:
        """The attention call alone into ``out``, over the row plan in the registers from
        ``first_register`` (``step_registers()``' first, or ``kept_registers()``)."""
        regs = tuple(Reg(first_register + i) for i in range(len(row_kernels.ROW_PLAN_REGS)))
        return row_kernels.attend_call(regs, q, kv_layer, out, self._scale, self._softcap)

    def kept_registers(self, rows: torch.Tensor) -> tuple[int, ...]:
        """The row plan of ``rows`` alone (``forward_rows``' plan), as registers for a
        recorded ``record_attend``; valid until the next call or ``plan()``."""
        self._kept = self._rows.of_rows(rows)
        return self._kept.registers()

    def step_registers(self) -> tuple[int, ...]:
        """The registers of the calls ``record_layer`` made, for the step ``plan()`` planned."""
        return (*self._rows.registers(), self._write_rows.data_ptr())

    @torch.inference_mode()
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        if self._reference is not None:
            return self._reference.forward(q, k, v, kv_layer)
        write_kv(kv_layer, self._write_rows, k, v)
        return row_kernels.attend_rows(self._rows, q, kv_layer, self._scale, self._softcap)

    @torch.inference_mode()
    def forward_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Only ``rows`` attend (none: K/V written alone): a row's result depends only on
        its query and its keys, so each is the row ``forward`` computes, to the bit. More rows
        than sequences (prompt logprobs' rows): every row, as ``forward`` (one-row plans would
        pack each row's keys on its own: 1.08x the time of a scored 1K-2K-token prompt)."""
        if self._reference is not None:
            return self._reference.forward_rows(q, k, v, kv_layer, rows)
        if rows.numel() > self._rows.kv_lens.numel():
            return super().forward_rows(q, k, v, kv_layer, rows)
        write_kv(kv_layer, self._write_rows, k, v)
        if rows.numel() == 0:
            return q.new_empty((0, *q.shape[1:]))
        plan = self._rows.of_rows(rows)
        return row_kernels.attend_rows(
            plan, q.index_select(0, rows), kv_layer, self._scale, self._softcap
        )
