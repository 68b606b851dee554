"""Upstream mode's routing policy: which OpenAI-compatible server gets a request. No I/O.

- ``affinity_key(body)`` digests the part of a request that later requests will share, so
  they reach the replica whose prefix cache already holds it.
- ``UpstreamPool.choose(key)`` is bounded-load rendezvous hashing: every upstream scores
  blake2b(key + url) and the best-scored one owns the key. The owner takes the request unless
  it is at the load bound max(min_load, ceil(load_factor * (total_in_flight + 1) /
  num_healthy)); then the next-best under the bound does. ``min_load`` keeps a light load from
  being spread: a replica batches a few requests at once for free, while a prefix recomputed
  elsewhere costs a whole prefill. Adding or removing an upstream only moves the keys it owns.
- Health: a connection failure marks an upstream down for ``retry_after_s``; after that it
  is tried again (router/health_probe.py also asks each upstream's /health when this
  sidecar's is asked).

router/app.py does the HTTP.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from itertools import takewhile
from typing import Any, Literal

import msgspec

from prefixcache.sdk.stability import RANK

Route = Literal["affinity", "overflow", "failover"]
ROUTES: tuple[Route, ...] = ("affinity", "overflow", "failover")

PROMPT_KEY_CHARS = 2048  # completions: how much of a text prompt the key covers
PROMPT_KEY_TOKENS = 512  # ... and of a token-id prompt
SYSTEM_ROLES = frozenset({"system", "developer"})
SHARED_STABILITIES = frozenset({"static", "shared"})


# --- the affinity key ---------------------------------------------------------------------


def affinity_key(body: Mapping[str, Any]) -> bytes:
    """sha256 of the model and the request's shared prefix, as canonical JSON.

    Any decoded JSON object is accepted: a body the upstream will reject still gets a key.
    """
    segments = body.get("segments")
    if isinstance(segments, list) and segments and not body.get("messages"):
        prefix = segment_prefix(segments)
    elif "messages" in body:
        prefix = message_prefix(body["messages"])
    else:
        prefix = prompt_prefix(body.get("prompt"))
    canonical = msgspec.json.encode([body.get("model"), prefix], order="sorted")
    return hashlib.sha256(canonical).digest()


def message_prefix(messages: Any) -> list[Any]:
    """The leading system/developer messages; without any, the first message.

    Requests that share a system prompt share a key; a conversation without one is keyed by
    its first message, so turn N+1 (history appended) keeps the key of turn 1.
    """
    if not isinstance(messages, list):
        return [messages]
    return list(takewhile(_is_system_message, messages)) or messages[:1]


def segment_prefix(segments: list[Any]) -> list[Any]:
    """The static and shared segments in stability order; without any, the first session
    segment (the start of the conversation). Dynamic segments never count.

    Each counts as ``{role, content}``, what the upstream sees, so a static system segment
    keys the same as the equal system message.
    """
    ordered = sorted(segments, key=_stability_rank)  # stable: declared order within a class
    shared = [_as_message(s) for s in ordered if _stability(s) in SHARED_STABILITIES]
    if shared:
        return shared
    return [_as_message(s) for s in ordered if _stability(s) == "session"][:1]


def prompt_prefix(prompt: Any) -> Any:
    """The head of a completions prompt: text, token ids, or a batch of one of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:PROMPT_KEY_CHARS]
    if isinstance(prompt, list):
        return prompt[:PROMPT_KEY_TOKENS]
    return prompt


def _is_system_message(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") in SYSTEM_ROLES


def _stability(segment: Any) -> str:
    value = segment.get("stability") if isinstance(segment, dict) else None
    return value if isinstance(value, str) else "dynamic"


def _stability_rank(segment: Any) -> int:
    return RANK.get(_stability(segment), RANK["dynamic"])


def _as_message(segment: dict[str, Any]) -> dict[str, Any]:
    return {"role": segment.get("role"), "content": segment.get("content")}


# --- the pool -----------------------------------------------------------------------------


@dataclass(slots=True)
class Upstream:
    url: str  # base URL without a trailing slash, e.g. http://10.0.0.7:8000/v1
    in_flight: int = 0  # requests sent and not finished (streams until their last byte)
    down_until: float = 0.0  # pool clock time before which it is skipped


@dataclass(slots=True, frozen=True)
class Choice:
    upstream: Upstream
    # affinity: the key's owner took it; overflow: the owner was at its load bound;
    # failover: the owner is down or already failed this request.
    route: Route


@dataclass(slots=True)
class UpstreamPool:
    urls: InitVar[Sequence[str]]
    load_factor: float = 1.25
    retry_after_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    min_load: int = 8  # below this many in flight an upstream always takes its own keys
    upstreams: list[Upstream] = field(init=False)

    def __post_init__(self, urls: Sequence[str]) -> None:
        normalized = [url.rstrip("/") for url in urls]
        if not normalized:
            raise ValueError("upstream mode needs at least one upstream URL")
        for url in normalized:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream URL must start with http:// or https://: {url!r}")
        if len(set(normalized)) != len(normalized):
            raise ValueError("upstream URLs must be distinct")
        if self.load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must not be negative")
        if self.min_load < 1:
            raise ValueError("min_load must be at least 1")
        self.upstreams = [Upstream(url) for url in normalized]

    # --- choosing -------------------------------------------------------------------------

    def choose(self, key: bytes, exclude: Collection[str] = ()) -> Choice | None:
        """The upstream for ``key``, skipping those down or in ``exclude`` (URLs this request
        already failed on); None when no upstream is left."""
        ranked = sorted(self.upstreams, key=lambda u: _score(key, u.url), reverse=True)
        now = self.clock()
        candidates = [u for u in ranked if now >= u.down_until and u.url not in exclude]
        if not candidates:
            return None
        total = sum(u.in_flight for u in candidates)
        bound = max(self.min_load, math.ceil(self.load_factor * (total + 1) / len(candidates)))
        # Never empty: the least loaded candidate has at most total / n < bound in flight.
        chosen = next(u for u in candidates if u.in_flight < bound)
        owner = ranked[0]
        if chosen is owner:
            return Choice(chosen, "affinity")
        return Choice(chosen, "overflow" if owner is candidates[0] else "failover")

    def healthy(self) -> list[Upstream]:
        """Upstreams not marked down, in configuration order."""
        now = self.clock()
        return [u for u in self.upstreams if now >= u.down_until]

    # --- bookkeeping ----------------------------------------------------------------------

    def acquire(self, upstream: Upstream) -> None:
        upstream.in_flight += 1

    def release(self, upstream: Upstream) -> None:
        if upstream.in_flight <= 0:
            raise RuntimeError(f"release without acquire on {upstream.url}")
        upstream.in_flight -= 1

    def mark_down(self, upstream: Upstream) -> None:
        upstream.down_until = self.clock() + self.retry_after_s

    def mark_up(self, upstream: Upstream) -> None:
        upstream.down_until = 0.0

    def is_healthy(self, upstream: Upstream) -> bool:
        return self.clock() >= upstream.down_until


def _score(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")
