"""Progress bars on stderr (tqdm) for model fetch/load and the benches.

A bar is drawn when ``$PREFIXCACHE_PROGRESS`` says so (``1``/``on``: always, ``0``/``off``:
never) or, when it is unset, when stderr is a terminal; otherwise ``progress_bar`` returns a
silent stand-in, so logs, pipes and ``--json`` output never see one. tqdm is imported only
when a bar is drawn (it comes with the ``serve`` extra; without it there is no bar).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

from .. import settings
from ..settings import PROGRESS_ENV as PROGRESS_ENV  # the variable's name, for callers

T = TypeVar("T")


class ProgressBar(Protocol):
    def update(self, n: float = 1) -> Any: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...
    def close(self) -> Any: ...
    def __enter__(self) -> ProgressBar: ...
    def __exit__(self, *exc: object) -> Any: ...


class _Silent:
    """What ``progress_bar`` returns when no bar is wanted: every call does nothing."""

    __slots__ = ()

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_wanted() -> bool:
    setting = settings.progress_setting()
    if setting is not None:
        return setting
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(
    desc: str, total: float | None = None, unit: str = "it", leave: bool = True
) -> ProgressBar:
    """A tqdm bar on stderr, or a silent stand-in. ``unit="B"``: sizes in KiB/MiB/GiB."""
    if not progress_wanted():
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent()
    in_bytes = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=in_bytes,
        unit_divisor=1024 if in_bytes else 1000,
        file=sys.stderr,
        leave=leave,
        mininterval=0.2,
        **_screen_size(),
    )


def _screen_size() -> dict[str, Any]:
    """tqdm follows the terminal's width, except where stderr is a terminal that reports a
    0 x 0 size (some ptys do; tqdm would then draw nothing): 80 x 20 there."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal, or no file descriptor
        return {"dynamic_ncols": True}
    if size.columns and size.lines:
        return {"dynamic_ncols": True}
    return {"ncols": size.columns or 80, "nrows": size.lines or 20}


def progress_iter(
    items: Iterable[T], desc: str, total: int | None = None, unit: str = "it"
) -> Iterator[T]:
    """``items`` one by one, advancing a bar per item (``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress_bar(desc, total, unit) as bar:
        for item in items:
            yield item
            bar.update()
