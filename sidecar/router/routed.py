"""One routed request's bookkeeping in upstream mode (``Routed``): the pending prefill it puts
on its replica, the decision's metrics, the cached tokens the upstream reports, and the KV
events its prefill should cause."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from .cache_aware import CacheAwareRouter, Decision, PendingPrefill, Replica
from .metrics import UpstreamMetrics
from .pool import Upstream


def legacy_route(decision: Decision) -> str:
    """The hash policy's route label for a cache-aware decision (one series for both)."""
    if decision.reason == "failover":
        return "failover"
    return "overflow" if decision.overflow else "affinity"


FIRST_OUTPUT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]|"finish_reason"\s*:\s*"')
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


class Routed:
    """One routed request's bookkeeping: its pending prefill on the replica until its first
    output comes back (the whole answer when not streamed), the predicted and reported cached
    tokens, and the events it should cause."""

    def __init__(
        self,
        router: CacheAwareRouter | None,
        metrics: UpstreamMetrics,
        upstream: Upstream,
        decision: Decision | None,
        token_ids: list[int] | None = None,
    ) -> None:
        self.metrics = metrics
        self.upstream = upstream
        self.decision = decision
        self.replica: Replica | None = None
        self._finished = False
        self._reported = False
        if decision is not None and router is not None:
            self.replica = router.replicas[upstream.url]
            self.replica.pending[id(self)] = PendingPrefill(token_ids, decision.prefill_tokens)
            metrics.decisions.labels(upstream.url, decision.reason).inc()
            metrics.requests.labels(upstream.url, legacy_route(decision)).inc()
            metrics.predicted_cached.labels(upstream.url).inc(decision.predicted_tokens)

    def first_byte(self) -> None:
        if self.replica is not None:
            self.replica.answering(id(self))

    def report(self, data: bytes) -> None:
        if self._reported or self.decision is None:
            return
        if (found := CACHED_TOKENS.search(data)) is not None:
            self._reported = True
            self.metrics.reported_cached.labels(self.upstream.url).inc(int(found.group(1)))

    def abandon(self) -> None:
        """The connection failed: the request never ran there."""
        self._finished = True
        if self.replica is not None:
            self.replica.finished(id(self))

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        replica, decision = self.replica, self.decision
        if replica is not None:
            replica.finished(id(self))
        if replica is None or decision is None or replica.subscriber is None:
            return
        block_size = replica.index.block_size if replica.index is not None else None
        if decision.prefill_tokens >= (block_size or 16):
            replica.subscriber.expect()  # new full blocks: events should follow

    async def watch(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Relay ``events``; the prefill is over at the first generated text (an opening
        chunk with only the role may come before it)."""
        async for chunk in events:
            if FIRST_OUTPUT.search(chunk):
                self.first_byte()
            self.report(chunk)
            yield chunk
