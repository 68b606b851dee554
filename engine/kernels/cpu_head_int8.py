"""The LM head from a GGUF Q8_0 (or Q5_0) weight in integer arithmetic (``cpu_head_int8.cpp``),
opt-in with ``$PREFIXCACHE_INT8_HEAD=1``.

A one-row head call (a lone stream's decode step, every first token) reads the whole head;
the default kernel (``cpu_gemm``'s ``q8_amx``) turns each weight into its bf16 value first,
which bounds it below the memory's rate. Here each row's activations become exact integers
per block of 32 and the weight bytes are multiplied as stored (VPDPBUSD; TDPBSUD on
AMX-INT8 from 9 rows, the same integers): about 1.1-1.2x faster for one to four rows, slower
from eight, batch-invariant, and nearer the exact ``q * scale . x`` than a bf16 rounding of each
weight, so not the default kernels' bits (bench/lm_head.py). Needs AVX512_VNNI and the native
build.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from .. import settings
from . import cpu_gemm, cpu_library, gemm_blocks

SOURCE = Path(__file__).with_name("cpu_head_int8.cpp")
KERNEL = "q8_int"  # the PackedLinear's kernel name


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pc_head_i8_packed_bytes.argtypes = [i64, i64]
    lib.pc_head_i8_packed_bytes.restype = i64
    lib.pc_head_i8.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int, c_int]
    lib.pc_head_i8.restype = None
    lib.pc_head_i8_enable_amx.argtypes = []
    lib.pc_head_i8_enable_amx.restype = c_int


_library = cpu_library.CpuLibrary(
    SOURCE, "CPU integer LM head", "the bf16 head", _declare, (cpu_library.AMX_HEADER,),
    targets=(cpu_library.AVX512_VNNI,),
)  # fmt: skip


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The kernel where it can run: the native GEMM build loaded (not the AVX2 one) and the
    CPU's AVX512_VNNI; its AMX path where AMX-INT8 is granted too. Decided once per process."""
    if not cpu_gemm.available() or cpu_gemm.native_target() is not cpu_library.AVX512_BF16:
        return None
    lib = _library.load()
    if lib is not None and cpu_library.amx_int8_wanted() and lib.pc_head_i8_enable_amx() != 0:
        cpu_library.log.info("integer LM head on AMX off: the kernel refused the tile state")
    return lib


def available() -> bool:
    """Whether a Q8_0 LM head can run in integer arithmetic here (building on first use)."""
    return _lib() is not None


def wanted() -> bool:
    """Whether models loaded now take it: ``$PREFIXCACHE_INT8_HEAD`` on and the kernel here."""
    return settings.int8_head_enabled() and available()


def pack(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """The kernel's layout of ``q`` int8 ``[N, K]`` and ``scale`` ``[N, K / 32]``: per group of
    32 columns (N padded with zero columns) and block of 32 k, ``q + 128`` as
    ``[8 k-quads][32 columns][4]`` bytes, then the block's 32 fp32 scales."""
    n, k = q.shape
    groups, blocks = -(-n // 32), k // 32
    qp = np.zeros((groups * 32, k), dtype=np.int8)
    qp[:n] = q
    biased = qp.view(np.uint8) ^ np.uint8(0x80)  # q + 128, two's complement
    ints = biased.reshape(groups, 32, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    ints = np.ascontiguousarray(ints).reshape(groups, blocks, 1024)
    return gemm_blocks.with_column_values(groups, blocks, ints, scale)


def head_from_blocks(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    source: gemm_blocks.BlockSource,
    float_out: bool = True,
) -> cpu_gemm.PackedLinear | None:
    """The LM head (``float_out``: fp32 logits) from ``weight``'s Q8_0-style blocks (``q``
    int8, one scale per 32 k, no minimum; ``weight`` their bf16 rounding) on this kernel.
    None where it does not run here or the blocks are another form."""
    lib = _lib()
    q, scale, minimum = source
    n, k = q.shape
    if lib is None or minimum is not None or weight.dtype != torch.bfloat16 or k % 32:
        return None
    if scale.shape != (n, k // 32) or tuple(weight.shape) != (n, k):
        return None
    if not gemm_blocks.rounds_to(weight, source):
        return None
    packed = pack(q, scale)
    cpu_library.require(packed.numel() == lib.pc_head_i8_packed_bytes(n, k), "the layout's size")
    return cpu_gemm.PackedLinear.on_blocks(packed, lib.pc_head_i8, KERNEL, (n, k), bias, float_out)
