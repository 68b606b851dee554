"""The engine's AVX512_BF16 C++ sources: each built once, loaded through ``ctypes``.

A ``CpuLibrary`` compiles its one source with plain ``g++`` (no torch headers, a few seconds)
into ``$PREFIXCACHE_HOME/kernels``, keyed by source, compiler, flags and CPU, and loads it;
``ctypes`` releases the GIL for each call. Where the CPU lacks AVX-512 (F, BW, VL) with
AVX512_BF16, no compiler is found, the build fails or ``PREFIXCACHE_CPU_KERNELS=0`` is set,
``load()`` returns None (logged once) and callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
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


def unavailable_reason(cpuinfo: str | None = None) -> str | None:
    """Why the engine's CPU kernels cannot run here (None when they can be tried)."""
    if not settings.cpu_kernels_enabled():
        return f"{settings.CPU_KERNELS_ENV}=0"
    missing = REQUIRED_FLAGS - cpu_flags(cpuinfo)
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if compiler() is None:
        return "no C++ compiler (set CXX, or install g++)"
    return None


def require(ok: bool, what: str) -> None:
    """A check at a kernel boundary, kept under ``python -O`` (where ``assert`` is gone): a
    wrong pointer, length or dtype there is memory corruption, not an exception."""
    if not ok:
        raise ValueError(f"kernel call refused: {what}")


def gemm_rows(
    x: torch.Tensor, dtype: torch.dtype, in_features: int, what: str
) -> tuple[torch.Size, torch.Tensor]:
    """``x`` ``[..., in_features]`` as the 2-D rows a CPU GEMM kernel takes (last axis
    contiguous), and its leading shape; a clear error for another dtype, device or width."""
    if x.dtype != dtype or x.device.type != "cpu" or x.shape[-1] != in_features:
        raise ValueError(f"{what} got {tuple(x.shape)} {x.dtype} on {x.device}")
    rows = x.reshape(-1, in_features)
    return x.shape[:-1], rows if rows.stride(1) == 1 else rows.contiguous()


def compiler() -> str | None:
    override = settings.compiler_override()
    return (override and shutil.which(override)) or shutil.which("g++") or shutil.which("c++")


class CpuLibrary:
    """One C++ source, built on first ``load()`` and declared by ``declare`` (argtypes);
    ``label`` and ``fallback`` name it and what runs without it, in the log; ``headers``
    are the local headers it includes (part of the build key)."""

    __slots__ = ("_declare", "_loaded", "_lock", "fallback", "headers", "label", "source")

    def __init__(
        self,
        source: Path,
        label: str,
        fallback: str,
        declare: Callable[[ctypes.CDLL], None],
        headers: tuple[Path, ...] = (),
    ) -> None:
        self.source, self.label, self.fallback, self._declare = source, label, fallback, declare
        self.headers = headers
        self._lock = threading.Lock()
        self._loaded: list[ctypes.CDLL | None] = []  # empty until the first load()

    def library_path(self, cxx: str) -> Path:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        key = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            *(h.read_bytes() for h in self.headers),
            version.stdout.encode(),
            " ".join(CXX_FLAGS).encode(),
        ):
            key.update(part)
        key.update(" ".join(sorted(cpu_flags() & REQUIRED_FLAGS)).encode())
        return settings.home_dir() / "kernels" / f"{self.source.stem}-{key.hexdigest()[:16]}.so"

    def _build(self, cxx: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            done = subprocess.run(
                [cxx, *CXX_FLAGS, "-o", tmp, str(self.source)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)  # atomic: concurrent first uses do not see half a file
        finally:
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
            reason = unavailable_reason()
            if reason is None:
                try:
                    cxx = compiler()
                    assert cxx is not None
                    path = self.library_path(cxx)
                    if not path.exists():
                        self._build(cxx, path)
                    lib = ctypes.CDLL(str(path))
                    self._declare(lib)
                    log.info("%s: %s", self.label, path)
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    reason = f"build or load failed: {exc}"
            if reason is not None:
                log.info("%s off (%s): %s is used", self.label, reason, self.fallback)
            self._loaded.append(lib)
            return lib
