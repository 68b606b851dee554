"""The engine's C++ kernel sources: each built once for this CPU, loaded through ``ctypes``.

A ``CpuLibrary`` compiles its one source with plain ``g++`` (no torch headers, a few seconds)
into ``$PREFIXCACHE_HOME/kernels``, keyed by source, compiler, target and CPU, and loads it;
``ctypes`` releases the GIL for each call. The sources are written for AVX-512; two targets
build them:

- ``avx512_bf16``: natively, where the CPU has AVX-512 (F, BW, VL) and AVX512_BF16 (and
  ``amx_bf16``, the same build, for a source written for AMX where the CPU also has it);
- ``avx2``: on AVX2 + FMA + F16C CPUs, through SIMDe (``libsimde-dev``), which maps each 512-bit
  intrinsic onto 256-bit ones, with ``avx512_on_avx2.h`` supplying the few it lacks.
  ``-ffp-contract=off`` keeps every multiply-add where the source wrote it, so the kernels'
  batch invariance holds there too; ``PC_NARROW_VECTORS`` selects the GEMM's 256-bit tile.
  bf16 arithmetic is emulated there, 4-14x slower than torch's (bench/gemm_invariance.py,
  bench/cpu_attention.py): the library that exists only for bf16 speed (the non-invariant
  attention kernel) lists ``NATIVE_ONLY`` and leaves such CPUs to torch; the layer ops and
  the quantized GEMM build there for fp32 only (their bf16 entry points sit under
  ``#ifndef PC_NARROW_VECTORS``); the batch-invariant GEMM and attention take both dtypes,
  since on AVX2 they are what keeps a batched bf16 run equal to a lone one (fp32, the
  default dtype there, runs at torch's speed or better).

``PREFIXCACHE_CPU_KERNELS=avx2`` builds every library for the second, bf16 included, even
where the first could run (how the emulation's bits are checked on an AVX-512 machine).
Where no target can build (CPU, no compiler, no SIMDe, a failed build,
``PREFIXCACHE_CPU_KERNELS=0``), ``load()`` returns None (logged once) and callers keep
torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import settings
from .cpu_features import cpu_flags

if TYPE_CHECKING:
    import torch

log = logging.getLogger("prefixcache.engine")

REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
CXX_FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mfma",
    "-fopenmp",  # libgomp: the same runtime torch's CPU wheel loads, so one thread pool
    "-fPIC",
    "-shared",
)
SHIM = Path(__file__).with_name("avx512_on_avx2.h")
AMX_HEADER = Path(__file__).with_name("cpu_amx.h")  # for the sources with an AMX path


@dataclass(frozen=True, slots=True)
class Target:
    """One way to build the sources: the CPU flags it needs, the compiler flags, the headers
    it force-includes (part of the build key) and whether it needs SIMDe."""

    name: str
    needs: frozenset[str]
    flags: tuple[str, ...]
    headers: tuple[Path, ...] = ()
    needs_simde: bool = False


AVX512_BF16 = Target("avx512_bf16", REQUIRED_FLAGS, CXX_FLAGS)
AVX2 = Target(
    "avx2",
    frozenset({"avx2", "fma", "f16c"}),
    (
        "-O3",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-ffp-contract=off",
        "-DPC_NARROW_VECTORS",
        "-Wno-psabi",  # SIMDe's 64-byte structs passed by value: a note, not a problem
        "-include",
        str(SHIM),
        "-fopenmp",
        "-fPIC",
        "-shared",
    ),
    (SHIM,),
    needs_simde=True,
)
# The same build where the CPU also has AMX: for the AMX kernels, used only there.
AMX_BF16 = Target("amx_bf16", REQUIRED_FLAGS | {"amx_tile", "amx_bf16"}, CXX_FLAGS)
# The same build where the CPU also has AVX512_VNNI: for the integer LM head, used only there.
AVX512_VNNI = Target("avx512_vnni", REQUIRED_FLAGS | {"avx512_vnni"}, CXX_FLAGS)
TARGETS = (AVX512_BF16, AVX2)
NATIVE_ONLY = (AVX512_BF16,)  # for libraries that compute bf16 only


@functools.cache
def simde_found(cxx: str) -> bool:
    """Whether ``cxx`` finds SIMDe's AVX-512 header (``libsimde-dev``, or on ``CPATH``)."""
    try:
        done = subprocess.run(
            [cxx, "-x", "c++", "-E", "-include", "simde/x86/avx512.h", "-", "-o", os.devnull],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def select_target(
    cpuinfo: str | None = None, targets: tuple[Target, ...] = TARGETS
) -> Target | str:
    """The first of ``targets`` that can build here (AVX2 alone where the setting forces it),
    or why none can."""
    if not settings.cpu_kernels_enabled():
        return f"{settings.CPU_KERNELS_ENV}=0"
    if settings.cpu_kernels_forced_avx2():
        targets = (AVX2,)
    flags = cpu_flags(cpuinfo)
    reasons = []
    for target in targets:
        missing = target.needs - flags
        if missing:
            reasons.append(f"the CPU lacks {', '.join(sorted(missing))} ({target.name})")
            continue
        cxx = compiler()
        if cxx is None:
            return "no C++ compiler (set CXX, or install g++)"
        if target.needs_simde and not simde_found(cxx):
            reasons.append(
                f"SIMDe's headers are not installed: apt install libsimde-dev ({target.name})"
            )
            continue
        return target
    return "; ".join(reasons)


def unavailable_reason(
    cpuinfo: str | None = None, targets: tuple[Target, ...] = TARGETS
) -> str | None:
    """Why the engine's CPU kernels cannot run here (None when they can be tried)."""
    chosen = select_target(cpuinfo, targets)
    return chosen if isinstance(chosen, str) else None


def amx_wanted(cpuinfo: str | None = None) -> bool:
    """Whether kernels with an AMX path should take it: the CPU has AMX-TILE and AMX-BF16 and
    ``$PREFIXCACHE_CPU_AMX`` is not off (the kernel's grant of the tile state is asked later)."""
    return settings.cpu_amx_enabled() and AMX_BF16.needs <= cpu_flags(cpuinfo)


def amx_int8_wanted(cpuinfo: str | None = None) -> bool:
    """Whether the integer kernels should take their AMX path: AMX-TILE and AMX-INT8 here and
    ``$PREFIXCACHE_CPU_AMX`` not off."""
    return settings.cpu_amx_enabled() and {"amx_tile", "amx_int8"} <= cpu_flags(cpuinfo)


def require(ok: bool, what: str) -> None:
    """A check at a kernel boundary, kept under ``python -O`` (where ``assert`` is gone): a
    wrong pointer, length or dtype there is memory corruption, not an exception."""
    if not ok:
        raise ValueError(f"kernel call refused: {what}")


def gemm_rows(
    x: torch.Tensor, dtypes: tuple[torch.dtype, ...], in_features: int, what: str
) -> torch.Tensor:
    """``x`` ``[..., in_features]`` as the 2-D rows a GEMM kernel takes (last axis contiguous);
    a clear error for another dtype, device or width (``what`` names the layer). Kept to a few
    attribute reads: it runs once per projection of every decode step."""
    if x.dtype not in dtypes or not x.is_cpu or x.shape[-1] != in_features:
        raise ValueError(f"{what} got {tuple(x.shape)} {x.dtype} on {x.device}")
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def compiler() -> str | None:
    override = settings.compiler_override()
    return (override and shutil.which(override)) or shutil.which("g++") or shutil.which("c++")


class CpuLibrary:
    """One C++ source, built on first ``load()`` and declared by ``declare`` (argtypes);
    ``label`` and ``fallback`` name it and what runs without it, in the log; ``headers``
    are the local headers it includes (part of the build key); ``targets`` the builds it
    may take, best first (where no setting forces one); ``target`` the one it took (None
    until loaded, or where none); ``flags``: this library's own compiler flags (a macro that
    selects some of the source's entries: the row attention's library per dtype)."""

    __slots__ = (
        "_declare",
        "_loaded",
        "_lock",
        "fallback",
        "flags",
        "headers",
        "label",
        "source",
        "target",
        "targets",
    )

    def __init__(
        self,
        source: Path,
        label: str,
        fallback: str,
        declare: Callable[[ctypes.CDLL], None],
        headers: tuple[Path, ...] = (),
        targets: tuple[Target, ...] = TARGETS,
        flags: tuple[str, ...] = (),
    ) -> None:
        self.source, self.label, self.fallback, self._declare = source, label, fallback, declare
        self.headers, self.targets, self.flags = headers, targets, flags
        self.target: Target | None = None
        self._lock = threading.Lock()
        self._loaded: list[ctypes.CDLL | None] = []  # empty until the first load()

    def unavailable_reason(self, cpuinfo: str | None = None) -> str | None:
        """Why this library cannot run here (None when it can be tried)."""
        return unavailable_reason(cpuinfo, self.targets)

    def library_path(self, cxx: str, target: Target = AVX512_BF16) -> Path:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        key = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            *(h.read_bytes() for h in (*self.headers, *target.headers)),
            version.stdout.encode(),
            " ".join(target.flags).encode(),
            " ".join(self.flags).encode(),
        ):
            key.update(part)
        key.update(" ".join(sorted(cpu_flags() & target.needs)).encode())
        name = f"{self.source.stem}-{target.name}-{key.hexdigest()[:16]}.so"
        return settings.home_dir() / "kernels" / name

    def _build(self, cxx: str, target: Target, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
        os.close(fd)
        process = _compile([cxx, *target.flags, *self.flags, "-o", tmp, str(self.source)])
        try:
            _, err = process.communicate(timeout=300)
            if process.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {err.strip()[-2000:]}")
            os.replace(tmp, path)  # atomic: concurrent first uses do not see half a file
        finally:
            if process.poll() is None:  # timed out
                process.kill()
                process.wait()
            if os.path.exists(tmp):
                os.unlink(tmp)

    def load(self) -> ctypes.CDLL | None:
        """The compiled library, building it on first use; None where it cannot run here."""
        if self._loaded:  # asked on every call: no lock once decided
            return self._loaded[0]
        with self._lock:
            if self._loaded:
                return self._loaded[0]
            lib = None
            chosen = select_target(targets=self.targets)
            reason = chosen if isinstance(chosen, str) else None
            if isinstance(chosen, Target):
                try:
                    cxx = compiler()
                    assert cxx is not None
                    path = self.library_path(cxx, chosen)
                    if not path.exists():
                        self._build(cxx, chosen, path)
                    lib = ctypes.CDLL(str(path))
                    self._declare(lib)
                    self.target = chosen
                    log.info("%s (%s): %s", self.label, chosen.name, path)
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    reason = f"build or load failed ({chosen.name}): {exc}"
            if reason is not None:
                log.info("%s off (%s): %s is used", self.label, reason, self.fallback)
            self._loaded.append(lib)
            return lib


# One compiler process per CPU at a time, over every library's builds (whatever threads ask).
_COMPILE_SLOTS = threading.BoundedSemaphore(max(1, len(os.sched_getaffinity(0))))


def _compile(command: list[str]) -> subprocess.Popen[str]:
    """``command`` started once a compile slot is free; the slot is freed when it exits. It
    runs niced where ``nice`` is found: a first start's model load (the same CPUs) goes first."""
    _COMPILE_SLOTS.acquire()
    nice = shutil.which("nice")
    try:
        process = subprocess.Popen(
            [nice, "-n", "10", *command] if nice else command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    except BaseException:
        _COMPILE_SLOTS.release()
        raise

    def free_on_exit() -> None:
        process.wait()
        _COMPILE_SLOTS.release()

    threading.Thread(target=free_on_exit, name="prefixcache-compile", daemon=True).start()
    return process


def load_in_background(loads: Sequence[Callable[[], object]]) -> list[threading.Thread]:
    """Run each of ``loads`` (a library's ``load()``, or a function that calls it) on a daemon
    thread, as many at once as this process has CPUs, in the order given: libraries not yet
    built compile side by side while the caller goes on (their first real use waits for the
    build under the library's lock, as before). Built one at a time as each was first used,
    a first start of SmolLM2 took 25.9-27.5 s on a 2-vCPU Xeon; side by side 17.7-19.3 s."""
    pending = list(loads)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                load = pending.pop(0)
            load()  # a failed build is logged by load() and leaves torch's ops in place

    threads = [
        threading.Thread(target=work, name=f"prefixcache-kernel-build-{i}", daemon=True)
        for i in range(min(len(pending), len(os.sched_getaffinity(0))))
    ]
    for thread in threads:
        thread.start()
    return threads  # (join them to wait for every build)
