"""Batch-invariant GEMM on AVX-512 CPUs (``cpu_gemm.cpp``): ``x @ W.T + b``, bf16 or fp32.

Each output element is one fp32 accumulator over ascending k, computed the same way in
every tile, so a row's result is a function of that row alone: not of how many rows share
the call, of the row's place, or of the thread split. oneDNN's and MKL's GEMMs pick kernels
and tail paths by M, and a row's bits change with its batch (bench/gemm_invariance.py shows
where). ``available()`` is false (callers keep torch's GEMM) where the library cannot load;
see ``cpu_library``.

Where the CPU has AMX (AMX-TILE, AMX-BF16), bf16 weights whose K is a multiple of 32 run
``cpu_gemm_amx.cpp`` instead, on the same packed panels: 4x the AVX-512 kernel's rate at 8
rows, 6-13x from 64 (bench/gemm_invariance.py), as batch-invariant, with other bits. A
weight takes one kernel for its life, at every M, so no row ever mixes the two
(``$PREFIXCACHE_CPU_AMX=0`` keeps AVX-512).

The integer LM head (``cpu_head_int8``) reads blocks through ``PackedLinear.on_blocks`` too.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_library, cpu_replay
from .gemm_blocks import BlockSource, pack_blocks, rounds_to

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
AMX_SOURCE = Path(__file__).with_name("cpu_gemm_amx.cpp")
AMX_K_STEP = 32  # the AMX kernel's k per tile step; other K keep the AVX-512 kernel
# Rows up to which a weight with blocks beside its panels (AVX-512 without AMX) reads the
# blocks: cpu_gemm.cpp's block tile (12 rows, each block converted once). Per form, Gemma 3's
# and SmolLM2's GEMMs at 12 rows: q8 1.10x the panels' speed (the Q8_0 heads 1.08-1.21x),
# q4 1.05x, q4f16 1.15x; at 16 (two tiles) slower. q8h (a scale per 16 k: Q6_K) is 1.71x at
# 6 rows and 0.86x at 8 (docs/benchmarks.md, "Block tiles of 12 rows").
FEW_ROWS = 12
FEW_ROWS_OF_FORM = {"q8h": 6}
# pc_gemm_weight_rows' layout code of each packing that gives W's rows back
_ROW_LAYOUTS = {"amx": 0, "avx512": 0, "f32": 1, "q8_amx": 2, "q8h_amx": 3}
DTYPES = (torch.bfloat16, torch.float32)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pc_gemm_packed_words.argtypes = [i64, i64, c_int]
    lib.pc_gemm_packed_words.restype = i64
    for name in ("pc_gemm_pack_bf16", "pc_gemm_pack_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, i64, i64, ptr]
        fn.restype = None
    lib.pc_gemm_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int, c_int]
    lib.pc_gemm_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int]
    lib.pc_gemm_bf16.restype = lib.pc_gemm_f32.restype = None
    for fn in (lib.pc_gemm_q8, lib.pc_gemm_q8h, lib.pc_gemm_q4, lib.pc_gemm_q4f16):
        fn.argtypes = lib.pc_gemm_bf16.argtypes
        fn.restype = None
    lib.pc_gemm_weight_rows.argtypes = [ptr, c_int, i64, i64, ptr, i64, ptr, c_int]
    lib.pc_gemm_weight_rows.restype = None


def _declare_amx(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pc_amx_enable.argtypes = []
    lib.pc_amx_enable.restype = c_int
    for fn in (
        lib.pc_gemm_bf16_amx,
        lib.pc_gemm_q8_amx,
        lib.pc_gemm_q8h_amx,
        lib.pc_gemm_q4_amx,
        lib.pc_gemm_q4f16_amx,
    ):
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int, c_int]
        fn.restype = None


_library = cpu_library.CpuLibrary(
    SOURCE, "CPU GEMM", "torch's GEMM (not batch-invariant)", _declare
)
_amx_library = cpu_library.CpuLibrary(
    AMX_SOURCE, "CPU GEMM on AMX", "the AVX-512 GEMM", _declare_amx, (cpu_library.AMX_HEADER,),
    targets=(cpu_library.AMX_BF16,),
)  # fmt: skip


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first use, a few seconds)."""
    return _library.load() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether ``PackedLinear`` takes this weight (CPU, bf16 or fp32, 2-D) and the kernel loads."""
    return (
        weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2 and available()
    )


@functools.cache
def _amx_lib() -> ctypes.CDLL | None:
    """The AMX kernel where it may run: ``cpu_library.amx_wanted()``, the native AVX-512 build
    loaded (not the AVX2 one a setting forced), the library built and the kernel's grant of
    the tile state. Decided once per process, so every weight agrees."""
    if not cpu_library.amx_wanted() or not available():
        return None
    if _library.target is not cpu_library.AVX512_BF16:
        return None
    lib = _amx_library.load()
    if lib is None:
        return None
    if lib.pc_amx_enable() != 0:
        cpu_library.log.info("CPU GEMM on AMX off: the kernel refused the AMX tile state")
        return None
    return lib


def native_target() -> cpu_library.Target | None:
    """The build the GEMM library took (None until loaded, or where none)."""
    return _library.target


def amx_available() -> bool:
    """Whether bf16 weights with K a multiple of 32 run on AMX here (building on first use)."""
    return _amx_lib() is not None


def avx512_blocks_available() -> bool:
    """Whether ``pc_gemm_q8`` runs here: the native AVX-512 build (not the AVX2 one's
    emulation)."""
    return available() and _library.target is cpu_library.AVX512_BF16


def reads_blocks() -> bool:
    """Whether bf16 weights here may read their GGUF blocks (``PackedLinear.from_blocks``): on
    AMX at every row count, on AVX-512 without it for calls of few rows."""
    return amx_available() or avx512_blocks_available()


def _lib() -> ctypes.CDLL:
    lib = _library.load()
    if lib is None:
        raise RuntimeError("cpu_gemm used where available() is false")
    return lib


class PackedLinear:
    """``x @ weight.T + bias`` for a weight fixed at load, packed once into the kernel's
    panels (the packed copy replaces oneDNN's; a layer's original weight is then freed,
    ``linear.Gemm.release_weight``). ``kernel`` names the one it runs for life: ``amx``,
    ``avx512``, ``f32``, or from GGUF blocks on AMX ``q8_amx``, ``q8h_amx``, ``q4_amx`` or
    ``q4f16_amx``; without AMX a weight from blocks keeps ``avx512`` for many rows and names
    its blocks' kernel for few in ``few_rows_kernel`` (``q8``, ``q8h``, ``q4``, ``q4f16``).
    ``float_out``: a bf16 weight's outputs are the fp32 sums, not rounded to bf16 (the LM
    head: logits a bf16 rounding would tie at the argmax)."""

    __slots__ = ("_bias_ptr", "_f32_out", "_few", "_fn", "_packed_ptr", "_what", "bias")
    __slots__ += ("blocks", "dtype", "few_rows_kernel", "in_features", "kernel", "out_dtype")
    __slots__ += ("out_features", "packed")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False
    ) -> None:
        if not supports(weight):
            raise ValueError("PackedLinear needs a 2-D bf16 or fp32 CPU weight and the kernel")
        lib = _lib()
        weight = weight.detach()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        bf16 = weight.dtype == torch.bfloat16
        words = lib.pc_gemm_packed_words(self.out_features, self.in_features, int(bf16))
        self.packed = torch.empty(words, dtype=torch.int32 if bf16 else torch.float32)
        pack = lib.pc_gemm_pack_bf16 if bf16 else lib.pc_gemm_pack_f32
        pack(
            weight.data_ptr(), weight.stride(0), self.out_features, self.in_features,
            self.packed.data_ptr(),
        )  # fmt: skip
        self.bias = None if bias is None else bias.detach().float().contiguous()
        # Resolved once: a decode step makes one call per projection, where a few
        # microseconds of lookups are a measurable share (bench/step_overhead.py).
        self._fn = lib.pc_gemm_bf16 if bf16 else lib.pc_gemm_f32
        amx = _amx_lib() if bf16 and self.in_features % AMX_K_STEP == 0 else None
        self.kernel = "amx" if amx is not None else "avx512" if bf16 else "f32"
        if amx is not None:
            self._fn = amx.pc_gemm_bf16_amx
        self.out_dtype = torch.float32 if float_out else self.dtype
        self._f32_out = (int(float_out),) if bf16 else ()  # the bf16 entries' flag
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self._what = f"PackedLinear({self.in_features} -> {self.out_features}, {self.dtype})"
        self.blocks: torch.Tensor | None = None
        self.few_rows_kernel: str | None = None
        self._few: tuple[ctypes._CFuncPtr, int, int] | None = None  # kernel, blocks, rows

    @classmethod
    def from_blocks(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        source: BlockSource,
        float_out: bool = False,
    ) -> PackedLinear | None:
        """``PackedLinear(weight, bias, float_out)`` from ``weight``'s GGUF blocks
        (``source``: ``q`` int8 ``[N, K]``, ``scale`` and ``minimum`` or None ``[N, K / 32]``,
        ``weight`` = bf16(q * scale (+ minimum)), ``gguf_blocks.split_blocks``'s form, or a
        scale per 16 k ``[N, K / 16]`` and no minimum, ``split_q6_k``'s): the same outputs to
        the bit, the weights read at 0.625 or 0.75 (4-bit integers), 1.06 or 1.25 bytes (wider)
        instead of 2 (a one-row step reads every weight). On AMX every form; long calls
        convert the blocks once per chunk of rows, overlapped with the tile work: as fast as
        the panels from 2,048 rows, faster below (``cpu_gemm_amx.cpp``'s ``X_CHUNK_BYTES``).
        Without AMX the weight keeps its panels and adds the blocks (``blocks``,
        ``few_rows_kernel``: ``cpu_gemm.cpp``'s ``gemm_blocks``, the panels' bits), which
        calls of up to ``few_rows`` rows read (``FEW_ROWS``, or ``FEW_ROWS_OF_FORM``'s): a
        decode step, a prefill's last row through the LM head, at the memory's rate from fewer
        bytes; more rows run the panels. None where
        neither runs, or where ``weight`` is not that rounding (``gemm_blocks.pack_blocks``:
        the forms)."""
        amx = _amx_lib()
        q, scale, minimum = source
        n, k = q.shape
        if weight.dtype != torch.bfloat16 or k % AMX_K_STEP or not reads_blocks():
            return None
        halves = scale.shape == (n, k // 16)  # Q6_K: a scale per 16 k, no minimum
        if tuple(weight.shape) != (n, k) or not (scale.shape == (n, k // 32) or halves):
            return None
        if minimum is not None and (minimum.shape != scale.shape or halves):
            return None
        if not rounds_to(weight, source):
            return None
        packing = pack_blocks(q, scale, minimum)
        if packing is None:
            return None
        packed, form = packing
        if amx is not None:
            fn = getattr(amx, f"pc_gemm_{form}_amx")
            return cls.on_blocks(packed, fn, f"{form}_amx", (n, k), bias, float_out)
        self = cls(weight, bias, float_out)  # AVX-512: the panels, the blocks for few rows
        self.blocks, self.few_rows_kernel = packed, form
        rows = FEW_ROWS_OF_FORM.get(form, FEW_ROWS)
        self._few = (getattr(_lib(), f"pc_gemm_{form}"), packed.data_ptr(), rows)
        return self

    @classmethod
    def on_blocks(
        cls,
        packed: torch.Tensor,
        fn: ctypes._CFuncPtr,
        kernel: str,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
        float_out: bool,
    ) -> PackedLinear:
        """A ``PackedLinear`` whose kernel ``fn`` reads ``packed`` blocks (bf16 rows in)."""
        self = cls.__new__(cls)
        self.packed, self._fn, self.kernel = packed, fn, kernel
        self.out_features, self.in_features = shape
        self.dtype = torch.bfloat16
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_dtype = torch.float32 if float_out else torch.bfloat16
        self._f32_out = (int(float_out),)
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self._what = f"PackedLinear({shape[1]} -> {shape[0]}, GGUF blocks, {kernel})"
        self.blocks, self.few_rows_kernel, self._few = None, None, None
        return self

    def call(self, x2: torch.Tensor, out: torch.Tensor) -> cpu_replay.KernelCall:
        """The kernel's call for ``x2`` ``[M, K]`` (``cpu_library.gemm_rows``) into ``out``
        ``[M, N]`` (``out_dtype``, the last axis contiguous)."""
        m, n = x2.shape[0], self.out_features
        cpu_library.require(
            x2.shape[1] == self.in_features and x2.stride(1) == 1 and x2.dtype == self.dtype,
            "x2 [M, K] of the weight's dtype, the last axis contiguous",
        )
        cpu_library.require(
            out.shape == (m, n) and out.stride(1) == 1 and out.dtype == self.out_dtype,
            "out [M, N] of the kernel's out dtype, the last axis contiguous",
        )
        kind = cpu_replay.GEMM_BF16 if self._f32_out else cpu_replay.GEMM_F32
        fn, packed = self._fn, self._packed_ptr
        if self._few is not None and m <= self._few[2]:
            fn, packed, _ = self._few
        return cpu_replay.KernelCall(
            kind, fn,
            (x2.data_ptr(), x2.stride(0), m, packed, n, self.in_features,
             self._bias_ptr, out.data_ptr(), out.stride(0), *self._f32_out,
             torch.get_num_threads()),
        )  # fmt: skip

    @property
    def few_rows(self) -> int:
        """Calls of up to this many rows read the blocks (0: none, or no panels beside them):
        ``FEW_ROWS``, or its form's ``FEW_ROWS_OF_FORM``."""
        return 0 if self._few is None else self._few[2]

    @property
    def gives_rows(self) -> bool:
        """Whether ``weight_rows`` reads W's rows back from this packing (bf16 or fp32 panels,
        Q8 blocks; not Q4 ones)."""
        return self.kernel in _ROW_LAYOUTS

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W ``[*ids.shape, K]`` in the weight's dtype, read back from the
        packing (``pc_gemm_weight_rows``): the panels hold W's values as packed; Q8 blocks give
        bf16(q * scale), the rounding ``from_blocks`` checked W to be. So a tied LM head
        serves the embedding's rows."""
        if not self.gives_rows:
            raise ValueError(f"{self._what} does not give its weight's rows")
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        n, k = self.out_features, self.in_features
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"row ids outside [0, {n})")
        out = torch.empty(flat.numel(), k, dtype=self.dtype)
        _lib().pc_gemm_weight_rows(
            self._packed_ptr, _ROW_LAYOUTS[self.kernel], n, k, flat.data_ptr(), flat.numel(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out.view(*ids.shape, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        x2 = cpu_library.gemm_rows(x, (self.dtype,), self.in_features, self._what)
        out = torch.empty(x2.shape[0], n, dtype=self.out_dtype)
        if x2.shape[0]:
            self.call(x2, out)()
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
