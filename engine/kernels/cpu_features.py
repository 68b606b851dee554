"""The CPU's instruction-set features, read at run time (never assumed from one machine)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """Feature flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``); empty where
    the file cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_bf16_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's native bf16 features (x86 AVX512_BF16 / AMX, Arm BF16)."""
    return cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The ``model name`` line of ``/proc/cpuinfo`` (benches report the CPU they ran on)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "unknown"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"
