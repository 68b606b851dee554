"""The engine's own CPU attention kernel (``cpu_attention.cpp``): built, loaded, called.

Both attention sources (this bf16 kernel and the batch-invariant row kernel,
``cpu_row_attention.cpp``, wrapped by ``row_kernels``, which shares the headers and the
constants here) are compiled once per source, compiler and CPU into
``$PREFIXCACHE_HOME/kernels`` by ``cpu_library`` (plain ``g++``, no torch headers, a few
seconds) and called through ``ctypes``, which releases the GIL for the call. This one needs
AVX512_BF16. Where it cannot build, ``load()`` returns None (logged once) and the caller
keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..kernels import cpu_library

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
ROW_SOURCE = Path(__file__).with_name("cpu_row_attention.cpp")
_LOCAL_HEADERS = ("cpu_simd.h", "cpu_flash_block.h", "cpu_flash_block_amx.h")
HEADERS = (*(Path(__file__).with_name(h) for h in _LOCAL_HEADERS), cpu_library.AMX_HEADER)
HEAD_DIMS = frozenset({32, 64, 96, 128, 256})
ROW_DTYPES = (torch.bfloat16, torch.float32)  # what row_attention takes (q and output)
# Pages row_attention reads besides q's dtype: fp8, read through exactly (kv_dtype.py)
FP8_SUFFIX = {torch.float8_e4m3fn: "_e4m3", torch.float8_e5m2: "_e5m2"}
REQUIRED_FLAGS = cpu_library.REQUIRED_FLAGS
NO_GROUPS = torch.zeros(0, 3, dtype=torch.int64)  # a step without cascade or prefill groups


# _declare is defined further down (with the entry points' argtypes): looked up at load().
_library = cpu_library.CpuLibrary(
    SOURCE,
    "CPU attention kernel",
    "torch's attention",
    lambda lib: _declare(lib),
    HEADERS,
    targets=cpu_library.NATIVE_ONLY,  # bf16 only, for speed: emulated bf16 is slower
)


def unavailable_reason(cpuinfo: str | None = None) -> str | None:
    """Why the attention kernel (``load()``) cannot run here (None when it can be tried)."""
    return _library.unavailable_reason(cpuinfo)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None where it cannot run here."""
    return _library.load()


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.pc_attention_bf16
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    fn.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.pc_paged_attention_bf16
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    fn.argtypes += [ctypes.c_float, ctypes.c_int, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.pc_merge_states_bf16
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
    fn.restype = None
    fn = lib.pc_paged_decode_bf16
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr]
    fn.argtypes += [i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
    fn.restype = ctypes.c_int


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attention`` takes these operands (CPU bf16, head dim 32/64/128, the last axis
    contiguous) and the kernel is loaded."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.shape[-1] in HEAD_DIMS
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and load() is not None
    )


def _outputs(rows: int, hq: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' result buffers: ``o`` bf16 ``[rows, hq, d]`` and the LSE ``[rows, hq]``."""
    return torch.empty(rows, hq, d, dtype=torch.bfloat16), torch.empty(
        rows, hq, dtype=torch.float32
    )


def check_rc(rc: int, d: int) -> None:
    if rc == -2:
        raise ValueError("CPU attention kernel: a sliding window needs causal rows and no groups")
    if rc != 0:
        raise ValueError(f"CPU attention kernel refused head dim {d}")


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[Lq, Hq, D]`` over ``k``/``v`` ``[Lk, Hk, D]`` (bf16, ``supports``
    true). ``causal`` is bottom-right aligned (query i sees keys up to ``i + Lk - Lq``).
    Returns the output ``[Lq, Hq, D]`` (bf16) and the base-2 LSE ``[Lq, Hq]`` (float32)."""
    lib = load()
    cpu_library.require(lib is not None, "the kernel must be loaded (supports() first)")
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    out, lse = _outputs(lq, hq, d)
    rc = lib.pc_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        out.data_ptr(), lse.data_ptr(),
        lq, lk, hq, hk, d, scale, int(causal), torch.get_num_threads(),
    )  # fmt: skip
    check_rc(rc, d)
    return out, lse


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    blocks: torch.Tensor,
    num_keys: int,
    scale: float,
    causal: bool = False,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` over the first ``num_keys`` keys held in the pages ``blocks`` (int32 block
    ids, in order) of ``kv_layer`` ``[num_blocks, 2, bs, Hk, D]``, read in place. ``window``
    (> 0, causal only): query i also drops keys ``<= i + num_keys - Lq - window``; pages before
    the first query's window are not read."""
    lib = load()
    cpu_library.require(
        lib is not None and kv_layer.is_contiguous(),
        "the kernel must be loaded and kv_layer contiguous",
    )
    cpu_library.require(
        blocks.dtype == torch.int32 and blocks.is_contiguous(),
        "blocks must be contiguous int32",
    )
    lq, hq, d = q.shape
    _, _, bs, hk, _ = kv_layer.shape
    cpu_library.require(num_keys <= blocks.numel() * bs, "num_keys exceeds the blocks given")
    out, lse = _outputs(lq, hq, d)
    rc = lib.pc_paged_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1),
        kv_layer.data_ptr(), bs, blocks.data_ptr(), out.data_ptr(), lse.data_ptr(),
        lq, num_keys, hq, hk, d, scale, int(causal), window, torch.get_num_threads(),
    )  # fmt: skip
    check_rc(rc, d)
    return out, lse


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    groups: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its KV pages, read in place (with ``window`` > 0, and no
    groups, over its last ``window`` keys only: the pages before them are not read).

    ``q`` ``[B, Hq, D]`` bf16; ``kv_layer`` ``[num_blocks, 2, bs, Hk, D]`` bf16 (contiguous);
    ``tables`` int32 ``[B, W]`` (block ids, row-major); ``lens`` int64 ``[B]`` (each >= 1, at
    most ``W * bs``). ``groups`` int64 ``[G, 3]``: cascade groups (first sequence, end, number
    of leading keys its members share, in the same pages), ascending and disjoint; the shared
    keys are read once for the whole group. Returns ``o`` ``[B, Hq, D]`` (bf16) and the base-2
    LSE ``[B, Hq]``."""
    lib = load()
    cpu_library.require(
        lib is not None and kv_layer.is_contiguous(),
        "the kernel must be loaded and kv_layer contiguous",
    )
    cpu_library.require(
        tables.dtype == torch.int32 and tables.is_contiguous() and lens.dtype == torch.int64,
        "tables must be contiguous int32, lens int64",
    )
    b, hq, d = q.shape
    _, _, bs, hk, _ = kv_layer.shape
    if groups is None:
        groups = NO_GROUPS
    cpu_library.require(
        groups.dtype == torch.int64 and groups.is_contiguous() and groups.shape[-1] == 3,
        "groups must be contiguous int64 [G, 3]",
    )
    out, lse = _outputs(b, hq, d)
    rc = lib.pc_paged_decode_bf16(
        q.data_ptr(), q.stride(0), q.stride(1),
        kv_layer.data_ptr(), bs, tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        groups.data_ptr(), groups.shape[0], out.data_ptr(), lse.data_ptr(),
        b, hq, hk, d, scale, window, torch.get_num_threads(),
    )  # fmt: skip
    check_rc(rc, d)
    return out, lse


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_ops.merge_states`` in one pass (the kernel loaded): ``o_*`` ``[N, H, D]``
    bf16, ``lse_*`` float32 ``[N, H]`` (base 2)."""
    lib = load()
    cpu_library.require(
        lib is not None and o_a.shape == o_b.shape,
        "the kernel must be loaded and the two states alike",
    )
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    out = torch.empty_like(o_a)
    lse = torch.empty_like(lse_a)
    d = o_a.shape[-1]
    lib.pc_merge_states_bf16(
        o_a.data_ptr(), lse_a.data_ptr(), o_b.data_ptr(), lse_b.data_ptr(),
        out.data_ptr(), lse.data_ptr(), o_a.numel() // d, d,
    )  # fmt: skip
    return out, lse
