"""Timeouts and the deadlines made from them (anyio clock seconds; None: no limit)."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import httpx


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds (None: no limit). ``connect``: opening a connection (also sending the body and
    waiting for a pooled one); ``first_token``: from sending a streamed request to its first
    text; ``total``: the whole call, retries and waits included."""

    connect: float | None = 10.0
    first_token: float | None = 120.0
    total: float | None = 600.0


def deadline_in(seconds: float | None) -> float | None:
    return None if seconds is None else anyio.current_time() + seconds


def earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - anyio.current_time())


def http_timeout(timeouts: Timeouts) -> httpx.Timeout:
    """httpx's limits: ``connect`` also bounds writing the body and waiting for a pooled
    connection; reads have none (the first-token and total deadlines bound them)."""
    t = timeouts.connect
    return httpx.Timeout(connect=t, read=None, write=t, pool=t)
