"""Batch-invariant GEMM on AVX-512 CPUs (``cpu_gemm.cpp``): ``x @ W.T + b``, bf16 or fp32.

Each output element is one fp32 accumulator over ascending k, computed the same way in
every tile, so a row's result is a function of that row alone: not of how many rows share
the call, of the row's place, or of the thread split. oneDNN's and MKL's GEMMs pick kernels
and tail paths by M, and a row's bits change with its batch (bench/gemm_invariance.py shows
where). ``available()`` is false (callers keep torch's GEMM) where the library cannot load;
see ``cpu_library``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import cpu_library

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
DTYPES = (torch.bfloat16, torch.float32)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pc_gemm_packed_words.argtypes = [i64, i64, c_int]
    lib.pc_gemm_packed_words.restype = i64
    for name in ("pc_gemm_pack_bf16", "pc_gemm_pack_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, i64, i64, ptr]
        fn.restype = None
    for name in ("pc_gemm_bf16", "pc_gemm_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int]
        fn.restype = None


_library = cpu_library.CpuLibrary(
    SOURCE, "CPU GEMM", "torch's GEMM (not batch-invariant)", _declare
)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first use, a few seconds)."""
    return _library.load() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether ``PackedLinear`` takes this weight (CPU, bf16 or fp32, 2-D) and the kernel loads."""
    return (
        weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2 and available()
    )


def _lib() -> ctypes.CDLL:
    lib = _library.load()
    if lib is None:
        raise RuntimeError("cpu_gemm used where available() is false")
    return lib


class PackedLinear:
    """``x @ weight.T + bias`` for a weight fixed at load, packed once into the kernel's
    panels (the packed copy replaces oneDNN's; the original weight stays for the state
    dict)."""

    __slots__ = ("_bias_ptr", "_fn", "_packed_ptr", "_what", "bias", "dtype", "in_features")
    __slots__ += ("out_features", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
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
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self._what = f"PackedLinear({self.in_features} -> {self.out_features}, {self.dtype})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        x2 = cpu_library.gemm_rows(x, (self.dtype,), k, self._what)
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=self.dtype)
        if m:
            self._fn(
                x2.data_ptr(), x2.stride(0), m, self._packed_ptr, n, k, self._bias_ptr,
                out.data_ptr(), n, torch.get_num_threads(),
            )  # fmt: skip
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
