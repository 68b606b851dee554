"""The batch-invariant attention kernel (``cpu_row_attention.cpp``): built, loaded, called.

Every query row of a step goes through one call per layer (``attend_rows``) over a plan
checked once per step (``plan_rows``); ``write_kv`` puts the step's K/V into the pages first.
Each entry is built as a ``KernelCall``, so a recorded step (``cpu_replay``) replays the same
calls: the plan's values are then its registers (``ROW_PLAN_REGS``). The source builds for
AVX-512 (AMX where the CPU has it) and AVX2 (fp32 at torch's speed, bf16 emulated); where it
cannot build, ``load_rows()`` returns None (logged once) and the CPU backend falls back to
the torch reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..kernels import cpu_library, cpu_replay
from ..kernels.cpu_replay import KernelCall, Reg
from .cpu_kernels import FP8_SUFFIX, HEADERS, NO_GROUPS, ROW_DTYPES, ROW_SOURCE, check_rc

# One library per row dtype (the source's PC_ROW_PART 1 and 2; both hold the K/V write): an
# engine builds only its own, 5.9 s (bf16) or 5.4 s (fp32) of g++ on a 2-vCPU Xeon against
# 10.9 s for the whole source, a first start's longest build.
_ROW_ENTRIES_OF = {torch.bfloat16: "pc_row_attention_bf16", torch.float32: "pc_row_attention_f32"}


def _row_library_of(dtype: torch.dtype, part: int) -> cpu_library.CpuLibrary:
    name = str(dtype).removeprefix("torch.")
    return cpu_library.CpuLibrary(
        ROW_SOURCE, f"CPU batch-invariant attention kernel ({name})", "the torch reference backend",
        lambda lib: _declare_rows(lib, dtype), HEADERS, flags=(f"-DPC_ROW_PART={part}",),
    )  # fmt: skip


_row_library = _row_library_of(torch.bfloat16, 1)
_row_f32_library = _row_library_of(torch.float32, 2)
ROW_LIBRARIES = {torch.bfloat16: _row_library, torch.float32: _row_f32_library}
_rows_amx: list[bool] = []  # decided once, at the bf16 library's load


def row_unavailable_reason(cpuinfo: str | None = None) -> str | None:
    """Why the batch-invariant kernel (``load_rows()``) cannot run here (None: it can be tried)."""
    return _row_library.unavailable_reason(cpuinfo)


def row_target(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The build the batch-invariant kernel for ``dtype`` rows loaded (``AVX512_BF16`` /
    ``AVX2``), None if none."""
    library = ROW_LIBRARIES[dtype]
    return None if load_rows(dtype) is None or library.target is None else library.target.name


def rows_on_amx() -> bool:
    """Whether the row kernel runs bf16 rows (head dims 64-256) on AMX tiles: decided once, at
    load (``cpu_library.amx_wanted()``, the native build, the kernel's grant)."""
    return load_rows() is not None and _rows_amx[0]


def load_rows(dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL | None:
    """The batch-invariant attention kernel for ``dtype`` rows (bf16 or fp32, its own library
    of ``cpu_row_attention.cpp``), built on first use; None where it cannot run here."""
    library = ROW_LIBRARIES.get(dtype)
    return None if library is None else library.load()


def _declare_rows(lib: ctypes.CDLL, dtype: torch.dtype) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pc_write_kv.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64]
    lib.pc_write_kv.argtypes += [i64, i64]
    lib.pc_write_kv.restype = ctypes.c_int
    for suffix in ("", *FP8_SUFFIX.values()):  # pages in q's dtype, then fp8 pages
        fn = getattr(lib, _ROW_ENTRIES_OF[dtype] + suffix)
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, ptr]
        fn.argtypes += [i64, i64, i64, ctypes.c_float, ctypes.c_float, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    if dtype == torch.bfloat16:
        lib.pc_row_enable_amx.argtypes, lib.pc_row_enable_amx.restype = [], ctypes.c_int
        # refused by the AVX2 build, and where the kernel withholds the tile state
        _rows_amx.append(cpu_library.amx_wanted() and lib.pc_row_enable_amx() == 0)


# What pc_write_kv's `page` says the pages hold: k's elements, or fp8 (clamped, rounded).
_PAGE_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def write_kv_call(
    kv_layer: torch.Tensor, rows: torch.Tensor | Reg, k: torch.Tensor, v: torch.Tensor
) -> KernelCall | None:
    """``write_kv``'s kernel call (``rows`` a tensor, or a register holding its address), or None
    where it does not apply (see ``write_kv``)."""
    if not kv_layer.is_cpu:
        return None
    lib = load_rows(k.dtype) if k.dtype in ROW_DTYPES else None
    if (
        lib is None
        or k.dtype != v.dtype
        or (kv_layer.dtype != k.dtype and kv_layer.dtype not in _PAGE_CODES)
        or k.stride(2) != 1
        or v.stride(2) != 1
    ):
        return None
    num_blocks, _, bs, hk, d = kv_layer.shape
    t = k.shape[0]
    cpu_library.require(
        kv_layer.is_contiguous() and k.shape == v.shape == (t, hk, d),
        "contiguous pages, k and v [T, Hk, D]",
    )
    if isinstance(rows, torch.Tensor):
        cpu_library.require(
            rows.dtype == torch.int64 and rows.is_contiguous() and rows.numel() == t,
            "rows int64 [T]",
        )
    return KernelCall(
        cpu_replay.WRITE_KV, lib.pc_write_kv,
        (kv_layer.data_ptr(), num_blocks * 2 * bs,
         k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
         rows if isinstance(rows, Reg) else rows.data_ptr(), t, bs, hk, d,
         k.element_size(), _PAGE_CODES.get(kv_layer.dtype, 0)),
    )  # fmt: skip


def write_kv(kv_layer: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``backend.write_kv`` in one call where it applies (the row kernel loaded, k and v bf16
    or fp32 with head rows contiguous, pages in their dtype or fp8, rounded as
    ``kv_dtype.to_kv`` rounds): K of token t into row ``rows[t]`` of the layer viewed as
    ``[num_blocks * 2 * bs, Hk, D]``, its V ``bs`` rows further. False: not applicable here,
    nothing written (the caller takes torch's ``index_copy_``)."""
    call = write_kv_call(kv_layer, rows, k, v)
    if call is None:
        return False
    cpu_library.require(call() == 0, "every KV row a K row inside the layer's pages")
    return True


@dataclass(frozen=True, slots=True)
class RowPlan:
    """A step's sequences for ``attend_rows``, checked once (``plan_rows``): every layer's
    call reuses them. See ``row_attention`` for what each tensor holds."""

    tables: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    groups: torch.Tensor
    window: int

    def registers(self) -> tuple[int, ...]:
        """The values of ``ROW_PLAN_REGS``, in order."""
        tables, groups = self.tables, self.groups
        return (
            tables.data_ptr(), tables.stride(0), self.qo_indptr.data_ptr(),
            self.kv_lens.data_ptr(), self.kv_lens.numel(), groups.data_ptr(), groups.shape[0],
            self.window,
        )  # fmt: skip

    def of_rows(self, rows: torch.Tensor) -> RowPlan:
        """The plan for query ``rows`` alone (int64, ascending or not): each a one-row
        sequence over its own sequence's table that sees the keys it saw here (``kv_len`` its
        position + 1), no groups. A row's arithmetic depends only on its query and its keys,
        so its output is the one this plan gives it, to the bit."""
        qo, kv_lens = self.qo_indptr, self.kv_lens
        seq = torch.searchsorted(qo[1:], rows, right=True)
        limits = kv_lens[seq] - qo[seq + 1] + rows + 1  # the row's position + 1
        tables = self.tables.index_select(0, seq) if rows.numel() else self.tables[:0]
        return plan_rows(
            tables.contiguous(), torch.arange(rows.numel() + 1), limits.contiguous(),
            window=self.window,
        )  # fmt: skip


def plan_rows(
    tables: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    groups: torch.Tensor | None = None,
    window: int = 0,
) -> RowPlan:
    groups = NO_GROUPS if groups is None else groups
    cpu_library.require(
        tables.dtype == torch.int32 and tables.is_contiguous(), "tables must be int32"
    )
    nseq = kv_lens.numel()
    cpu_library.require(
        qo_indptr.dtype == kv_lens.dtype == groups.dtype == torch.int64
        and qo_indptr.is_contiguous()
        and kv_lens.is_contiguous()
        and qo_indptr.numel() == nseq + 1
        and tables.shape[0] == nseq
        and groups.is_contiguous()
        and groups.shape[-1] == 3,
        "qo_indptr [S+1], kv_lens [S] and groups [G, 3] must be int64",
    )
    return RowPlan(tables, qo_indptr, kv_lens, groups, window)


# The per-step part of a row-attention call, as its registers in a replayed program
# (``RowPlan.registers``): tables, their row stride, qo_indptr, kv_lens, sequences, groups,
# their count, window.
ROW_PLAN_REGS = tuple(Reg(i) for i in range(8))
WRITE_ROWS_REG = Reg(len(ROW_PLAN_REGS))  # write_kv's rows


def attend_call(
    plan: RowPlan | tuple[Reg, ...],
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> KernelCall:
    """``attend_rows``' kernel call into ``out`` ``[T, Hq, D]`` (q's dtype, contiguous), over
    a plan or the registers that will hold one (``ROW_PLAN_REGS``). ``softcap`` > 0: each
    score s (q.k times ``scale``) becomes ``softcap * tanh(s / softcap)`` (Gemma 2)."""
    lib = load_rows(q.dtype if q.dtype in ROW_DTYPES else torch.bfloat16)
    if lib is None:
        raise RuntimeError("row_attention needs the CPU batch-invariant attention kernel")
    _, hq, d = q.shape
    _, _, bs, hk, _ = kv_layer.shape
    cpu_library.require(
        kv_layer.is_contiguous()
        and q.stride(-1) == 1
        and kv_layer.dtype in (q.dtype, *FP8_SUFFIX)
        and q.dtype in ROW_DTYPES,
        "q must be bf16 or fp32, kv_layer alike or fp8, with contiguous rows",
    )
    cpu_library.require(
        out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous(),
        "out [T, Hq, D] contiguous in q's dtype",
    )
    fn = _ROW_ENTRIES.get((q.dtype, kv_layer.dtype))
    if fn is None:
        fn = getattr(lib, _ROW_ENTRIES_OF[q.dtype] + FP8_SUFFIX.get(kv_layer.dtype, ""))
        _ROW_ENTRIES[(q.dtype, kv_layer.dtype)] = fn
    tables, stride, qo, kv_lens, nseq, groups, n_groups, window = (
        plan if isinstance(plan, tuple) else plan.registers()
    )
    return KernelCall(
        cpu_replay.ATTEND, fn,
        (q.data_ptr(), q.stride(0), q.stride(1), kv_layer.data_ptr(), bs, tables, stride, qo,
         kv_lens, nseq, groups, n_groups, out.data_ptr(), hq, hk, d, scale, softcap, window,
         torch.get_num_threads()),
    )  # fmt: skip


def attend_rows(
    plan: RowPlan, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """``row_attention`` over a ``plan_rows`` plan: the per-layer call."""
    out = torch.empty(q.shape, dtype=q.dtype)
    call = attend_call(plan, q, kv_layer, out, scale, softcap)
    check_rc(call(), q.shape[2])  # type: ignore[arg-type]
    return out


_ROW_ENTRIES: dict[tuple[torch.dtype, torch.dtype], ctypes._CFuncPtr] = {}


def row_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    groups: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The batch-invariant attention: every query row over its sequence's keys in the pages,
    one arithmetic whatever the step holds (see ``cpu_row_attention.cpp``); with ``window`` > 0
    (no groups), the row at position p over keys ``max(0, p - window + 1) .. p`` only; with
    ``softcap`` > 0, scores capped as ``softcap * tanh(score / softcap)``.

    ``q`` ``[T, Hq, D]`` bf16 or fp32 (``kv_layer`` alike, or fp8 for any q), rows of sequence
    s at ``qo_indptr[s]:qo_indptr[s+1]``, its last query seeing ``kv_lens[s]`` keys
    (bottom-right causal); ``kv_layer`` ``[num_blocks, 2, bs, Hk, D]`` with the step's K/V
    already written; ``tables`` int32 ``[S, W]``; ``groups`` int64 ``[G, 3]`` (first sequence,
    end, leading keys they share in the same pages), ascending and disjoint. Returns
    ``[T, Hq, D]`` in q's dtype. A step's layers share one ``plan_rows`` (what the CPU backend
    does); this is both in one call."""
    plan = plan_rows(tables, qo_indptr, kv_lens, groups, window)
    return attend_rows(plan, q, kv_layer, scale, softcap)
