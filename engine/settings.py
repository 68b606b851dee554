"""The engine's environment variables, each read here and nowhere else (docs/settings.md).

One typed accessor per variable. Each reads the environment when called, not at import, so a
variable set before first use (by a test, a bench or the CLI) is honoured. A leaf module: the
standard library only, no torch.

- ``PREFIXCACHE_HOME``: the root of what prefixcache keeps on this machine (compiled CPU
  kernels, the demo model, fetched models); ``~`` expanded; default ``~/.cache/prefixcache``.
- ``PREFIXCACHE_MODELS``: where named models are fetched to; default ``$PREFIXCACHE_HOME/models``.
- ``PREFIXCACHE_PROGRESS``: progress bars on stderr: ``1``/``on``/``true``/``yes`` always,
  ``0``/``off``/``false``/``no`` never, anything else (or unset): when stderr is a terminal.
- ``PREFIXCACHE_CPU_KERNELS``: ``0`` turns the engine's C++ kernels off; ``avx2`` builds them
  for AVX2 (through SIMDe) even where AVX512_BF16 is present; else each CPU gets its best.
- ``PREFIXCACHE_CPU_AMX``: ``0`` keeps the bf16 GEMM on AVX512_BF16 where the CPU has AMX
  (whose kernel is the default there); how the two kernels are compared on one machine.
- ``PREFIXCACHE_STEP_REPLAY``: ``0`` runs every step's kernels one Python call at a time, never
  as a recorded program (``step/step_replay.py``); how the two are compared.
- ``PREFIXCACHE_GGUF_BLOCKS``: ``0`` packs a dequantized bf16 GGUF model's weights as bf16
  panels only, never read from their GGUF blocks (on AMX, or for calls of a few rows on
  AVX-512: ``cpu_gemm.PackedLinear.from_blocks``, the same bits); how the two are compared.
- ``PREFIXCACHE_INT8_HEAD``: ``1`` runs a GGUF Q8_0 LM head (a dequantized bf16 model's) in
  integer arithmetic (``kernels/cpu_head_int8.cpp``): 1.1-1.2x faster for one to four rows (a
  lone stream's head call and first token), slower from eight; not the bf16 kernels' bits.
- ``CXX``: the C++ compiler that builds those kernels (else ``g++``, else ``c++``).
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "PREFIXCACHE_HOME"
MODELS_ENV = "PREFIXCACHE_MODELS"
PROGRESS_ENV = "PREFIXCACHE_PROGRESS"
CPU_KERNELS_ENV = "PREFIXCACHE_CPU_KERNELS"
CPU_AMX_ENV = "PREFIXCACHE_CPU_AMX"
STEP_REPLAY_ENV = "PREFIXCACHE_STEP_REPLAY"
GGUF_BLOCKS_ENV = "PREFIXCACHE_GGUF_BLOCKS"
INT8_HEAD_ENV = "PREFIXCACHE_INT8_HEAD"
CXX_ENV = "CXX"

_ON = ("1", "on", "true", "yes")
_OFF = ("0", "off", "false", "no")


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def home_dir() -> Path:
    """``$PREFIXCACHE_HOME``, else ``~/.cache/prefixcache``."""
    return _path(HOME_ENV) or Path.home() / ".cache" / "prefixcache"


def models_dir() -> Path:
    """``$PREFIXCACHE_MODELS``, else ``home_dir() / "models"``."""
    return _path(MODELS_ENV) or home_dir() / "models"


def progress_setting() -> bool | None:
    """``$PREFIXCACHE_PROGRESS``: True (on), False (off), None (unset or unrecognised: the
    caller decides, by whether stderr is a terminal)."""
    setting = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if setting in _ON:
        return True
    if setting in _OFF:
        return False
    return None


def cpu_kernels_enabled() -> bool:
    """False when ``$PREFIXCACHE_CPU_KERNELS`` is ``0``."""
    return os.environ.get(CPU_KERNELS_ENV, "1") != "0"


def cpu_kernels_forced_avx2() -> bool:
    """True when ``$PREFIXCACHE_CPU_KERNELS`` is ``avx2`` (the portable build, also where
    AVX-512 is present: how its bits are checked on such a machine)."""
    return os.environ.get(CPU_KERNELS_ENV, "").strip().lower() == "avx2"


def cpu_amx_enabled() -> bool:
    """False when ``$PREFIXCACHE_CPU_AMX`` is ``0``/``off``/``false``/``no``."""
    return os.environ.get(CPU_AMX_ENV, "1").strip().lower() not in _OFF


def step_replay_enabled() -> bool:
    """False when ``$PREFIXCACHE_STEP_REPLAY`` is ``0``/``off``/``false``/``no``."""
    return os.environ.get(STEP_REPLAY_ENV, "1").strip().lower() not in _OFF


def gguf_blocks_enabled() -> bool:
    """False when ``$PREFIXCACHE_GGUF_BLOCKS`` is ``0``/``off``/``false``/``no``."""
    return os.environ.get(GGUF_BLOCKS_ENV, "1").strip().lower() not in _OFF


def int8_head_enabled() -> bool:
    """True when ``$PREFIXCACHE_INT8_HEAD`` is ``1``/``on``/``true``/``yes`` (off by default)."""
    return os.environ.get(INT8_HEAD_ENV, "0").strip().lower() in _ON


def compiler_override() -> str | None:
    """``$CXX``, when set and not empty."""
    return os.environ.get(CXX_ENV) or None
