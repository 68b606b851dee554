"""The process heap: freed pages handed back to the OS after a large, one-off build."""

from __future__ import annotations

import contextlib
import ctypes


def release_freed_heap() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim``; a no-op
    elsewhere). Worth it after loads that free much more than they keep: a GGUF model's
    dequantization and packing left 315 MB of 1.3 GB; parsing Gemma 3's tokenizer (262K tokens,
    515K merges) 270 of 350 MB."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
