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
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from . import cpu_library, cpu_replay

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
AMX_SOURCE = Path(__file__).with_name("cpu_gemm_amx.cpp")
AMX_K_STEP = 32  # the AMX kernel's k per tile step; other K keep the AVX-512 kernel
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


def _declare_amx(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pc_amx_enable.argtypes = []
    lib.pc_amx_enable.restype = c_int
    for fn in (lib.pc_gemm_bf16_amx, lib.pc_gemm_q8_amx):
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


def amx_available() -> bool:
    """Whether bf16 weights with K a multiple of 32 run on AMX here (building on first use)."""
    return _amx_lib() is not None


def q8_pack(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """``pc_gemm_q8_amx``'s layout of ``q`` int8 ``[N, K]`` and ``scale`` ``[N, K / 32]``: per
    group of 32 columns (N padded with zero columns) and block of 32 k, the integers as
    ``[16 k-pairs][32 columns][2]``, then the block's 32 fp32 scales."""
    n, k = q.shape
    groups, blocks = -(-n // 32), k // 32
    qp = np.zeros((groups * 32, k), dtype=np.int8)
    qp[:n] = q
    sp = np.zeros((groups * 32, blocks), dtype=np.float32)
    sp[:n] = scale
    ints = qp.reshape(groups, 32, blocks, 16, 2).transpose(0, 2, 3, 1, 4)
    scales = sp.reshape(groups, 32, blocks).transpose(0, 2, 1)
    packed = np.concatenate(
        [
            np.ascontiguousarray(ints).view(np.uint8).reshape(groups, blocks, 1024),
            np.ascontiguousarray(scales).view(np.uint8).reshape(groups, blocks, 128),
        ],
        axis=2,
    )
    return torch.from_numpy(packed.reshape(-1))


def _lib() -> ctypes.CDLL:
    lib = _library.load()
    if lib is None:
        raise RuntimeError("cpu_gemm used where available() is false")
    return lib


class PackedLinear:
    """``x @ weight.T + bias`` for a weight fixed at load, packed once into the kernel's
    panels (the packed copy replaces oneDNN's; the original weight stays for the state
    dict). ``kernel`` names the one it runs for life: ``amx``, ``avx512`` or ``f32``.
    ``float_out``: a bf16 weight's outputs are the fp32 sums, not rounded to bf16 (the LM
    head: logits a bf16 rounding would tie at the argmax)."""

    __slots__ = ("_bias_ptr", "_f32_out", "_fn", "_packed_ptr", "_what", "bias", "dtype")
    __slots__ += ("in_features", "kernel", "out_dtype", "out_features", "packed")

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

    @classmethod
    def from_q8(
        cls, weight: torch.Tensor, q: np.ndarray, scale: np.ndarray, float_out: bool = False
    ) -> PackedLinear | None:
        """``PackedLinear(weight, None, float_out)`` on AMX from ``weight``'s Q8 source
        (GGUF's Q8_0: ``q`` int8 ``[N, K]``, ``scale`` ``[N, K / 32]``, ``weight`` = bf16(scale
        * q)): the same outputs to the bit, the weights read at 1.06 bytes instead of 2 (the
        LM head at one row reads its whole weight). None where AMX does not run here, or
        where ``weight`` is not that rounding of the source."""
        amx = _amx_lib()
        n, k = q.shape
        if amx is None or weight.dtype != torch.bfloat16 or k % AMX_K_STEP:
            return None
        if tuple(weight.shape) != (n, k) or scale.shape != (n, k // 32):
            return None
        for start in range(0, n, 8192):  # the kernel's weights are bf16(scale * q), exactly
            rows = slice(start, start + 8192)
            w = torch.from_numpy(q[rows]).float().view(-1, k // 32, 32)
            w = (w * torch.from_numpy(scale[rows]).float()[..., None]).view(-1, k)
            if not torch.equal(w.to(torch.bfloat16), weight[rows]):
                return None
        self = cls.__new__(cls)
        self.out_features, self.in_features = n, k
        self.dtype = torch.bfloat16
        self.packed = q8_pack(q, scale)
        self.bias = None
        self._fn = amx.pc_gemm_q8_amx
        self.kernel = "q8_amx"
        self.out_dtype = torch.float32 if float_out else torch.bfloat16
        self._f32_out = (int(float_out),)
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None
        self._what = f"PackedLinear({k} -> {n}, Q8 source, AMX)"
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
        return cpu_replay.KernelCall(
            kind, self._fn,
            (x2.data_ptr(), x2.stride(0), m, self._packed_ptr, n, self.in_features,
             self._bias_ptr, out.data_ptr(), out.stride(0), *self._f32_out,
             torch.get_num_threads()),
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        x2 = cpu_library.gemm_rows(x, (self.dtype,), self.in_features, self._what)
        out = torch.empty(x2.shape[0], n, dtype=self.out_dtype)
        if x2.shape[0]:
            self.call(x2, out)()
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
