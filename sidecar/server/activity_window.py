"""The last minutes of finished requests, in 10-second buckets: what the cache page's hit rate,
TTFT and requests-per-minute read, however busy the server (the engine remembers only its last
few thousand requests; this keeps totals, not requests).

``observe`` takes the engine's ``RequestRecord``s as a poller pulls them (every second, while
the app runs); a gap in their ``seq`` (more finished between two polls than the engine keeps)
is counted as ``missed``. TTFTs go into a log-scale histogram per bucket (16 bins a decade,
so a quantile is within ~8 %), which keeps a bucket's size bounded and buckets mergeable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from prefixcache.engine.api import RequestRecord

BUCKET_S = 10
WINDOW_S = 600
BINS_PER_DECADE = 16
MIN_TTFT_S = 1e-4  # bin 0 holds everything faster
MAX_BIN = 9 * BINS_PER_DECADE  # 1e5 s: the last bin holds everything slower


class WindowBucket(msgspec.Struct):
    start: float  # unix time, a multiple of BUCKET_S
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    missed: int = 0  # finished, but gone from the engine's memory before they were counted
    ttft: dict[int, int] = {}  # histogram bin -> requests (ttft_bin / ttft_of)


def ttft_bin(seconds: float) -> int:
    decades = math.log10(max(seconds, MIN_TTFT_S) / MIN_TTFT_S)
    return min(MAX_BIN, max(0, math.floor(decades * BINS_PER_DECADE)))


def ttft_of(bin_: int) -> float:
    """The bin's middle (geometric), in seconds."""
    return MIN_TTFT_S * 10 ** ((bin_ + 0.5) / BINS_PER_DECADE)


class ActivityWindow:
    """Buckets of the last ``WINDOW_S`` seconds (a few dozen, each a bounded histogram).
    ``version`` grows with every change; a viewer asks for the buckets changed ``since`` the
    version it last saw (0: all of them)."""

    def __init__(self) -> None:
        self._buckets: dict[float, WindowBucket] = {}
        self._updated: dict[float, int] = {}  # bucket start -> version of its last change
        self.cursor = 0  # the seq of the last record counted
        self.version = 0

    def observe(self, records: Iterable[RequestRecord]) -> None:
        for r in records:
            if r.seq <= self.cursor:
                continue
            bucket = self._bucket(r.finished_at)
            if self.cursor and r.seq > self.cursor + 1:
                bucket.missed += r.seq - self.cursor - 1
            self.cursor = r.seq
            bucket.requests += 1
            bucket.prompt_tokens += r.prompt_tokens
            bucket.cached_tokens += r.cached_tokens
            if r.ttft_s is not None:
                b = ttft_bin(r.ttft_s)
                bucket.ttft[b] = bucket.ttft.get(b, 0) + 1

    def since(self, version: int, now: float) -> list[WindowBucket]:
        """The window's buckets changed after ``version``, oldest first."""
        horizon = now - WINDOW_S - BUCKET_S
        for start in [s for s in self._buckets if s <= horizon]:
            del self._buckets[start], self._updated[start]
        changed = (s for s, v in self._updated.items() if v > version)
        return [self._buckets[s] for s in sorted(changed)]

    def _bucket(self, t: float) -> WindowBucket:
        start = math.floor(t / BUCKET_S) * BUCKET_S
        bucket = self._buckets.get(start)
        if bucket is None:
            bucket = self._buckets[start] = WindowBucket(start)
        self.version += 1
        self._updated[start] = self.version
        return bucket
