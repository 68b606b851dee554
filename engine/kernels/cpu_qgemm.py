"""Batch-invariant GEMM over block-quantized weights (``cpu_qgemm.cpp``).

The weight stays as small integers with a fp32 scale (and min) per 32 k, dequantized inside
the kernel: a decode reads 9 (``I8``) or 6 (``U4M``) bits a weight instead of bf16's 16 or
fp32's 32. Each output element is one fixed sequence (per block fresh partials over ascending
k, then scaled into one fp32 accumulator, blocks in ascending k), so a row's result is a
function of that row alone, as in ``cpu_gemm``. Activations are bf16 (VDPBF16PS, AVX512_BF16
CPUs: the native build only) or fp32 (AVX2 + FMA, both builds). ``computes(dtype)`` says
which run here; ``available()`` is false where the library cannot load (``cpu_library``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import cpu_library, cpu_replay

SOURCE = Path(__file__).with_name("cpu_qgemm.cpp")
BLOCK = 32  # k per scale
GROUP = 16  # output columns per packed group
I8, U4M = "i8", "u4m"  # w = s * q (q int8); w = s * q + mn (q in 0..15)
_FORMAT_CODES = {I8: 0, U4M: 1}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pc_qgemm_packed_bytes.argtypes = [i64, i64, c_int]
    lib.pc_qgemm_packed_bytes.restype = i64
    lib.pc_qgemm_pack.argtypes = [ptr, ptr, ptr, i64, i64, c_int, ptr]
    lib.pc_qgemm_pack.restype = None
    suffixes = ("f32", "bf16") if hasattr(lib, "pc_qgemm_bf16") else ("f32",)  # avx2: fp32
    for suffix in suffixes:
        fn = getattr(lib, f"pc_qgemm_{suffix}")
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, c_int, ptr, ptr, i64, c_int]
        fn.restype = None
        fn = getattr(lib, f"pc_qgemm_gather_{suffix}")
        fn.argtypes = [ptr, i64, i64, c_int, ptr, i64, ptr]
        fn.restype = None


_library = cpu_library.CpuLibrary(
    SOURCE, "CPU quantized GEMM", "dequantized GGUF weights", _declare
)
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_DTYPES = tuple(_SUFFIXES)  # what the activations may be


def unavailable_reason(cpuinfo: str | None = None) -> str | None:
    """Why the kernel cannot run here (None when it can be tried)."""
    return _library.unavailable_reason(cpuinfo)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first use, a few seconds)."""
    return _library.load() is not None


def dtype_reason(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take ``dtype`` activations here (None when it can)."""
    suffix = _SUFFIXES.get(dtype)
    if suffix is None:
        return f"the kernel computes bfloat16 or float32, not {str(dtype).removeprefix('torch.')}"
    lib = _library.load()
    if lib is None:
        return "the CPU quantized GEMM does not load here (see the log)"
    if not hasattr(lib, f"pc_qgemm_{suffix}"):
        target = _library.target.name if _library.target else "?"
        return f"its {target} build computes float32 only (bfloat16 needs AVX512_BF16)"
    return None


def computes(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` activations run here (building the kernel on first use)."""
    return dtype_reason(dtype) is None


def _entry(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    fn = _ENTRIES.get((name, dtype))  # checked once: the per-call lookups cost microseconds
    if fn is None:
        reason = dtype_reason(dtype)
        cpu_library.require(reason is None, f"cpu_qgemm {name} for {dtype}: {reason}")
        fn = _ENTRIES[(name, dtype)] = getattr(_lib(), f"pc_qgemm_{name}{_SUFFIXES[dtype]}")
    return fn


_ENTRIES: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}


def _lib() -> ctypes.CDLL:
    lib = _library.load()
    if lib is None:
        raise RuntimeError("cpu_qgemm used where available() is false")
    return lib


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A ``[n, k]`` weight packed for the kernel (layout at the top of ``cpu_qgemm.cpp``)."""

    packed: torch.Tensor  # uint8
    fmt: str
    n: int
    k: int

    @classmethod
    def pack(
        cls, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None = None
    ) -> QuantizedWeight:
        """From ``q`` int8 ``[n, k]`` (U4M: 0..15), ``scale`` (and ``minimum``, which makes it
        U4M) float32 ``[n, k / 32]``."""
        n, k = q.shape
        cpu_library.require(k % BLOCK == 0 and k > 0, "k a positive multiple of 32")
        cpu_library.require(scale.shape == (n, k // BLOCK), "one scale per block")
        fmt = I8 if minimum is None else U4M
        q = np.ascontiguousarray(q, dtype=np.int8)
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if minimum is not None:
            cpu_library.require(minimum.shape == scale.shape, "one min per block")
            minimum = np.ascontiguousarray(minimum, dtype=np.float32)
        lib = _lib()
        packed = torch.empty(lib.pc_qgemm_packed_bytes(n, k, _FORMAT_CODES[fmt]), dtype=torch.uint8)
        lib.pc_qgemm_pack(
            q.ctypes.data, scale.ctypes.data, None if minimum is None else minimum.ctypes.data,
            n, k, _FORMAT_CODES[fmt], packed.data_ptr(),
        )  # fmt: skip
        return cls(packed, fmt, n, k)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The parts' rows one after another (fused QKV, gate/up), or None where they cannot
        share one packed weight (formats or k differ, or a part but the last leaves a group
        half full)."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.k != first.k for p in parts):
            return None
        if any(p.n % GROUP for p in parts[:-1]):
            return None
        packed = torch.cat([p.packed for p in parts])
        return QuantizedWeight(packed, first.fmt, sum(p.n for p in parts), first.k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class QuantizedLinear:
    """``x @ W.T + bias`` for a bf16 or fp32 ``x`` (the output in ``x``'s dtype) and a
    ``QuantizedWeight``; ``gather(ids, dtype)``: rows of W (the tied embedding)."""

    __slots__ = ("_what", "bias", "in_features", "out_features", "weight")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.n, weight.k
        self._what = f"QuantizedLinear({weight.k} -> {weight.n})"
        self.bias = None if bias is None else bias.detach().float().contiguous()
        cpu_library.require(self.bias is None or self.bias.numel() == weight.n, "bias of n")

    def call(self, x2: torch.Tensor, out: torch.Tensor) -> cpu_replay.KernelCall:
        """The kernel's call for ``x2`` ``[M, K]`` (``cpu_library.gemm_rows``) into ``out``
        ``[M, N]`` (x's dtype, the last axis contiguous)."""
        m, n, w = x2.shape[0], self.out_features, self.weight
        cpu_library.require(
            x2.shape[1] == self.in_features and x2.stride(1) == 1 and x2.dtype in _DTYPES,
            "x2 [M, K] bf16 or fp32, the last axis contiguous",
        )
        cpu_library.require(
            out.shape == (m, n) and out.stride(1) == 1 and out.dtype == x2.dtype,
            "out [M, N] of x's dtype, the last axis contiguous",
        )
        return cpu_replay.KernelCall(
            cpu_replay.QGEMM, _entry("", x2.dtype),
            (x2.data_ptr(), x2.stride(0), m, w.packed.data_ptr(), w.n, w.k,
             _FORMAT_CODES[w.fmt], None if self.bias is None else self.bias.data_ptr(),
             out.data_ptr(), out.stride(0), torch.get_num_threads()),
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        x2 = cpu_library.gemm_rows(x, _DTYPES, self.in_features, self._what)
        out = torch.empty(x2.shape[0], n, dtype=x.dtype)
        if x2.shape[0]:
            self.call(x2, out)()
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def gather(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows ``ids`` of W ``[*ids.shape, k]``: s * q (+ mn) in fp32 as the dequantizer
        computes it, rounded once to ``dtype`` (bf16 or fp32)."""
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        w = self.weight
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.n):
            raise IndexError(f"row ids outside [0, {w.n})")
        out = torch.empty(flat.numel(), w.k, dtype=dtype)
        if flat.numel():
            _entry("gather_", dtype)(
                w.packed.data_ptr(), w.n, w.k, _FORMAT_CODES[w.fmt], flat.data_ptr(),
                flat.numel(), out.data_ptr(),
            )  # fmt: skip
        return out.view(*ids.shape, w.k)
