"""The decoder layer's elementwise ops in one pass each (``cpu_layer_ops.cpp``): residual add +
RMSNorm, Gemma's ``1 + w`` RMSNorm with its post-norm residual, rotary in place on q and k
(with Qwen3's or Gemma's per-head q/k norms), SiLU-and-mul, GELU-tanh-and-mul. bf16 on
AVX512_BF16 CPUs (all five); fp32 on those and on AVX2 + FMA CPUs (the norms and rotary: the
two activations' fp32 values are not torch's to the bit, so fp32 models keep torch's there).
``computes(dtype)`` says which run here.

At decode sizes torch's unfused ops cost more in per-op dispatch than in arithmetic (an
RMSNorm is eight ops); these are one ``ctypes`` call each. Each output is rounded where
torch's ops round it and RMSNorm sums in torch's order, so results are torch's bit for bit
(the tests compare with ``torch.equal``, SiLU and GELU over every bf16 gate value; GELU is
looked up in a table of torch's own). ``available()`` is false
(and ``llama`` keeps torch's ops) where the CPU lacks the features, no compiler is found or
``PREFIXCACHE_CPU_KERNELS=0`` is set; see ``cpu_library``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu_library, cpu_replay

SOURCE = Path(__file__).with_name("cpu_layer_ops.cpp")


_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for suffix in ("bf16", "f32") if hasattr(lib, "pc_rms_norm_bf16") else ("f32",):
        fn = getattr(lib, f"pc_rms_norm_{suffix}")
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, c_int]
        fn.restype = c_int
        fn = getattr(lib, f"pc_rotary_{suffix}")
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64]
        fn.argtypes += [ptr, ptr, ctypes.c_float, ctypes.c_float, c_int, c_int]
        fn.restype = c_int
        fn = getattr(lib, f"pc_gemma_norms_{suffix}")
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int]
        fn.restype = c_int
    if hasattr(lib, "pc_silu_and_mul_bf16"):
        fn = lib.pc_silu_and_mul_bf16
        fn.argtypes = [ptr, i64, ptr, i64, i64, i64, c_int]
        fn.restype = c_int
        fn = lib.pc_gelu_tanh_and_mul_bf16
        fn.argtypes = [ptr, i64, ptr, i64, i64, i64, c_int, ptr]
        fn.restype = c_int


_library = cpu_library.CpuLibrary(SOURCE, "CPU layer ops", "torch's elementwise ops", _declare)


def unavailable_reason(cpuinfo: str | None = None) -> str | None:
    """Why the ops cannot run here (None when they can be tried)."""
    return _library.unavailable_reason(cpuinfo)


def available() -> bool:
    """Whether the ops are built and loaded (building them on first use, a few seconds)."""
    return _library.load() is not None


def computes(dtype: torch.dtype) -> bool:
    """Whether the norms and rotary take ``dtype`` tensors here (bf16: the AVX512_BF16 build
    only; fp32: either build)."""
    lib = _library.load()
    return (
        lib is not None and dtype in _SUFFIXES and hasattr(lib, f"pc_rms_norm_{_SUFFIXES[dtype]}")
    )


def computes_silu_and_mul(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and computes(dtype)


def supports(t: torch.Tensor) -> bool:
    """Whether the norms and rotary take tensors like ``t`` (CPU, a dtype ``computes``)."""
    return t.device.type == "cpu" and computes(t.dtype)


def _lib() -> ctypes.CDLL:
    lib = _library.load()
    cpu_library.require(lib is not None, "cpu_layer_ops used where available() is false")
    return lib


def _entry(name: str, t: torch.Tensor) -> ctypes._CFuncPtr:
    fn = _ENTRIES.get((name, t.dtype))  # checked once: the per-call lookups cost microseconds
    if fn is None:
        cpu_library.require(computes(t.dtype), f"cpu_layer_ops {name} computes {t.dtype} here")
        fn = _ENTRIES[(name, t.dtype)] = getattr(_lib(), f"pc_{name}_{_SUFFIXES[t.dtype]}")
    return fn


_ENTRIES: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}


def _require_same_dtype(*tensors: torch.Tensor) -> None:
    cpu_library.require(
        len({t.dtype for t in tensors}) == 1, "the tensors (and weights) share one dtype"
    )


def norm_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> cpu_replay.KernelCall:
    """``out = weight * RMSNorm(x)`` over the last axis of ``x`` ``[T, H]`` (bf16 or fp32, rows
    strided, the last axis contiguous); with ``residual`` (``x`` and it contiguous),
    ``residual += x`` first and the norm of that sum."""
    rows, cols = x.shape
    cpu_library.require(
        x.stride(1) == 1 and weight.is_contiguous() and weight.shape == (cols,),
        "x.stride(1) == 1 and weight.is_contiguous() and weight.shape == (cols,)",
    )
    cpu_library.require(
        out.shape == x.shape and out.stride(1) == 1, "out.shape == x.shape and out.stride(1) == 1"
    )
    res_ptr, res_stride = None, 0
    if residual is not None:
        cpu_library.require(
            x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape,
            "x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape",
        )
        _require_same_dtype(x, residual)
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
    _require_same_dtype(x, weight, out)
    return cpu_replay.KernelCall(
        cpu_replay.NORM,
        _entry("rms_norm", x),
        (x.data_ptr(), x.stride(0), res_ptr, res_stride, weight.data_ptr(), out.data_ptr(),
         out.stride(0), rows, cols, eps, torch.get_num_threads()),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm_call`` into a new ``[T, H]`` tensor."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype)
    norm_call(x, weight, eps, out)()
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x``, then ``x = weight * RMSNorm(residual)``, both in place
    (``x`` and ``residual`` ``[T, H]`` contiguous, bf16 or fp32). Returns ``(x, residual)``."""
    norm_call(x, weight, eps, x, residual)()
    return x, residual


def _require_scale(scale: torch.Tensor, cols: int) -> None:
    cpu_library.require(
        scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == (cols,),
        "scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == (cols,)",
    )


def gemma_norms_call(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    post: torch.Tensor | None,
    pre: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> cpu_replay.KernelCall:
    """Gemma's RMSNorm entry (``h``, ``residual``, ``out`` ``[T, H]`` contiguous, bf16 or fp32;
    scales fp32 ``1 + weight``): ``out = norm(h, pre)``, or with ``residual`` and ``post``
    ``residual += norm(h, post)`` (in place) first and ``out = norm(residual, pre)``."""
    rows, cols = h.shape
    cpu_library.require(
        h.is_contiguous() and out.is_contiguous() and out.shape == h.shape,
        "h.is_contiguous() and out.is_contiguous() and out.shape == h.shape",
    )
    _require_scale(pre, cols)
    _require_same_dtype(h, out)
    if residual is not None or post is not None:
        cpu_library.require(
            residual is not None and post is not None, "a residual and its post-norm together"
        )
        cpu_library.require(
            residual.is_contiguous() and residual.shape == h.shape,  # type: ignore[union-attr]
            "residual.is_contiguous() and residual.shape == h.shape",
        )
        _require_scale(post, cols)  # type: ignore[arg-type]
        _require_same_dtype(h, residual)  # type: ignore[arg-type]
    return cpu_replay.KernelCall(
        cpu_replay.GEMMA_NORMS,
        _entry("gemma_norms", h),
        (h.data_ptr(), None if residual is None else residual.data_ptr(),
         None if post is None else post.data_ptr(), pre.data_ptr(), out.data_ptr(), rows, cols,
         eps, torch.get_num_threads()),
    )  # fmt: skip


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, ``x / rms(x) * scale`` in fp32 over ``x`` ``[T, H]`` (bf16 or fp32,
    contiguous), ``scale = 1 + weight`` (fp32 ``[H]``); a new ``[T, H]`` tensor."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype)
    gemma_norms_call(x, None, None, scale, out, eps)()
    return out


def gemma_add_norms(
    h: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, pre: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's sublayer exit and the next entry in one pass: ``residual += norm(h, post)``
    (in place), then ``norm(residual, pre)``, a new tensor (``h``, ``residual``
    ``[T, H]`` contiguous, bf16 or fp32; ``post``, ``pre`` fp32 ``1 + weight``). Returns
    ``(normed, residual)``."""
    out = torch.empty(h.shape[0], h.shape[1], dtype=h.dtype)
    gemma_norms_call(h, residual, post, pre, out, eps)()
    return out, residual


def rotary_call(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    gemma_norms: bool = False,
) -> cpu_replay.KernelCall:
    """``rotary_``'s entry (it returns nonzero for an odd head dim)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    cpu_library.require(
        q.stride(2) == 1 and k.stride(2) == 1 and k.shape[0] == t and k.shape[2] == d,
        "q.stride(2) == 1 and k.stride(2) == 1 and k.shape[0] == t and k.shape[2] == d",
    )
    cpu_library.require(
        cos.shape == sin.shape == (t, 1, d // 2) and cos.stride() == sin.stride(),
        "cos.shape == sin.shape == (t, 1, d // 2) and cos.stride() == sin.stride()",
    )
    cpu_library.require(cos.stride(2) == 1, "cos.stride(2) == 1")
    q_w = k_w = None
    eps = 0.0
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        cpu_library.require(
            q_weight.shape == k_weight.shape == (d,), "q_weight.shape == k_weight.shape == (d,)"
        )
        cpu_library.require(
            q_weight.is_contiguous() and k_weight.is_contiguous(),
            "q_weight.is_contiguous() and k_weight.is_contiguous()",
        )
        want = torch.float32 if gemma_norms else q.dtype
        cpu_library.require(
            q_weight.dtype == k_weight.dtype == want, "q/k norm weights of the norm's dtype"
        )
        q_w, k_w = q_weight.data_ptr(), k_weight.data_ptr()
    _require_same_dtype(q, k, cos, sin)
    return cpu_replay.KernelCall(
        cpu_replay.ROTARY,
        _entry("rotary", q),
        (q.data_ptr(), q.stride(0), q.stride(1), hq,
         k.data_ptr(), k.stride(0), k.stride(1), hk,
         cos.data_ptr(), sin.data_ptr(), cos.stride(0), t, d,
         q_w, k_w, eps, eps, int(gemma_norms), torch.get_num_threads()),
    )  # fmt: skip


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    gemma_norms: bool = False,
) -> None:
    """Rotate-half RoPE in place on ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` (bf16 or
    fp32, strided, the last axis contiguous) with ``cos``/``sin`` ``[T, 1, D/2]`` (the same).
    ``qk_norm`` (q weight ``[D]``, k weight ``[D]``, eps): a per-head RMSNorm of q and k
    first, in the same pass: Qwen3's (weights in q's dtype), or with ``gemma_norms`` Gemma's (fp32
    scales ``1 + weight``, as ``gemma_rms_norm``)."""
    if rotary_call(q, k, cos, sin, qk_norm, gemma_norms)() != 0:
        raise ValueError(f"rotary needs an even head dim, not {q.shape[2]}")


def _gated_args(gate_up: torch.Tensor, out: torch.Tensor, what: str) -> tuple[int, ...]:
    """The arguments both gated activations take, ``gate_up`` and ``out`` checked."""
    rows, width = gate_up.shape
    inter = width // 2
    cpu_library.require(
        gate_up.stride(1) == 1 and width == 2 * inter,
        "gate_up.stride(1) == 1 and width == 2 * inter",
    )
    cpu_library.require(computes_silu_and_mul(gate_up.dtype), f"{what} computes bf16 only")
    cpu_library.require(
        out.shape == (rows, inter) and out.stride(1) == 1 and out.dtype == torch.bfloat16,
        "out bf16 [T, I], the last axis contiguous",
    )
    return (gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, inter,
            torch.get_num_threads())  # fmt: skip


def silu_call(gate_up: torch.Tensor, out: torch.Tensor) -> cpu_replay.KernelCall:
    """``out = silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` (bf16, gate then up, rows strided,
    the last axis contiguous) into ``out`` ``[T, I]`` (bf16, the last axis contiguous)."""
    args = _gated_args(gate_up, out, "silu_and_mul")
    return cpu_replay.KernelCall(cpu_replay.SILU, _lib().pc_silu_and_mul_bf16, args)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` (``silu_call``); a new ``[T, I]`` tensor."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.bfloat16)
    silu_call(gate_up, out)()
    return out


@functools.cache
def gelu_tanh_table() -> torch.Tensor:
    """torch's bf16 ``gelu(x, approximate="tanh")`` of every bf16 ``x``, indexed by its bits
    (65,536 values and one pad: the kernel's gather reads 32 bits), built once."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    table = torch.zeros((1 << 16) + 1, dtype=torch.int16)
    table[: 1 << 16] = F.gelu(every, approximate="tanh").view(torch.int16)
    return table


def gelu_call(gate_up: torch.Tensor, out: torch.Tensor) -> cpu_replay.KernelCall:
    """``out = gelu_tanh(gate) * up`` for ``gate_up`` ``[T, 2I]``, as ``silu_call`` (bf16);
    GELU is torch's own value of each gate (``gelu_tanh_table``), the product rounded as
    torch's ``mul``."""
    args = (*_gated_args(gate_up, out, "gelu_tanh_and_mul"), gelu_tanh_table().data_ptr())
    return cpu_replay.KernelCall(cpu_replay.GELU, _lib().pc_gelu_tanh_and_mul_bf16, args)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up`` ``[T, 2I]`` (``gelu_call``); a new ``[T, I]``
    tensor."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.bfloat16)
    gelu_call(gate_up, out)()
    return out
