"""``EngineStats``: what a step reports becomes Prometheus series (``EngineMetrics``).

The engine reports events (a schedule, a computed step, a token, a finish) and the stats
collector keeps the counters, histograms and the deltas of the block manager's and the KV
tier's running totals; the gauges read live values at every scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..memory.hybrid.manager import HybridBlockManager
from ..memory.kv_tier import TierStats
from .metrics import EngineMetrics, GaugeValues

if TYPE_CHECKING:
    from ..memory.block_manager import BlockManager
    from ..memory.kv_tier import KVTier
    from ..step.sequence import Sequence


class EngineStats:
    def __init__(
        self, manager: BlockManager, tier: KVTier | None, metrics: EngineMetrics | None = None
    ) -> None:
        self.metrics = metrics or EngineMetrics()
        self._manager = manager
        self._tier = tier
        self._last = manager.stats()
        self._last_tier = tier.stats() if tier is not None else TierStats()
        hybrid = isinstance(manager, HybridBlockManager)
        self._local_tier = manager.local_tier if hybrid else None  # type: ignore[union-attr]
        if self._local_tier is not None:
            self._local_moves = self.metrics.count_local_tier()
            self._last_local = self._local_tier.stats()

    def watch_gauges(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """The gauges read the queues and the pool whenever they are collected."""
        manager, tier = self._manager, self._tier
        local = manager.local if isinstance(manager, HybridBlockManager) else None

        local_tier = manager.local_tier if isinstance(manager, HybridBlockManager) else None

        def values() -> GaugeValues:
            parts = [x.stats() for x in (tier, local_tier) if x is not None]  # hybrid: both
            return GaugeValues(
                running=running(),
                waiting=waiting(),
                in_use=manager.num_used_blocks,
                cached_idle=manager.num_cached_idle_blocks,
                free=manager.num_free_blocks,
                tier_used=sum(t.bytes_used for t in parts),
                tier_free=sum(t.bytes_free for t in parts),
                local_held=local.num_held if local is not None else 0,
                local_idle=local.num_idle if local is not None else 0,
                local_free=local.num_free if local is not None else 0,
            )

        self.metrics.read_gauges_from(values, local_pages=local is not None)

    def model(self, name: str, dtype: str) -> None:
        self.metrics.model_info.labels(name, dtype).set(1)

    # -- what a step reports -----------------------------------------------------------------

    def scheduled(self, num_preempted: int) -> None:
        self.metrics.preemptions.inc(num_preempted)

    def computed(self, prompt_tokens: int) -> None:
        """A model step ran: the prompt tokens it computed, and the cache's moves since."""
        self.metrics.prompt_tokens_computed.inc(prompt_tokens)
        self.cache_moved()

    def step_done(self, kind: str, seconds: float) -> None:
        self.metrics.step_duration.labels(kind).observe(seconds)

    def token(self, seq: Sequence, now: float) -> None:
        """``seq`` generated a token at ``now`` (its times not yet updated)."""
        m = self.metrics
        if seq.first_token_time is None:
            m.ttft.observe(now - seq.arrival_time)
        else:
            m.inter_token_latency.observe(now - (seq.last_token_time or now))
        m.generation_tokens.inc()

    def finished(self, seq: Sequence, reason: str, failure: str | None, now: float) -> None:
        m = self.metrics
        m.prompt_tokens.inc(seq.num_prompt_tokens)
        if failure is None:
            m.requests_finished.labels(reason).inc()
        else:
            m.requests_failed.labels(failure).inc()
        if seq.first_token_time is not None:
            m.e2e_latency.observe(now - seq.arrival_time)
        spans, cached = seq.request.segments or [], seq.num_cached_tokens or 0
        for p in seq.placements:  # position-independent hits, apart from prefix hits
            m.reuse_anywhere_segments.labels("stored" if p.stored else "computed").inc()
            m.reuse_anywhere_tokens.labels("placed").inc(p.num_tokens)
            span = spans[p.segment]
            hit = max(0, min(cached, span.end) - span.start)  # exact prefix hit inside it
            m.reuse_anywhere_tokens.labels("recomputed").inc(
                span.end - span.start - p.num_tokens - hit
            )

    # -- the cache ---------------------------------------------------------------------------

    def cache_moved(self) -> None:
        """Count the block manager's and the tier's totals since the last report."""
        m = self.metrics
        stats = self._manager.stats()
        last, self._last = self._last, stats
        m.prefix_cache_queries.inc(stats.query_tokens - last.query_tokens)
        reloaded = stats.reloaded_tokens - last.reloaded_tokens
        m.prefix_cache_hits.labels("pool").inc(stats.hit_tokens - last.hit_tokens - reloaded)
        if self._tier is not None:
            m.prefix_cache_hits.labels(self._tier.kind).inc(reloaded)
        self.tiers_moved()
        m.evictions.inc((stats.evicted_tokens - last.evicted_tokens) // stats.block_size)

    def tiers_moved(self) -> None:
        """Count the KV tiers' writes, reloads and drops since the last report."""
        m = self.metrics
        if self._tier is not None:
            tier = self._tier.stats()
            before, self._last_tier = self._last_tier, tier
            m.kv_tier_writes.inc(tier.writes - before.writes)
            m.kv_tier_reloads.inc(tier.reloads - before.reloads)
            m.kv_tier_drops.inc(tier.drops + tier.corrupt - before.drops - before.corrupt)
        if self._local_tier is not None:
            local = self._local_tier.stats()
            before, self._last_local = self._last_local, local
            self._local_moves.labels("written").inc(local.writes - before.writes)
            self._local_moves.labels("reloaded").inc(local.reloads - before.reloads)
            dropped = local.drops + local.corrupt - before.drops - before.corrupt
            self._local_moves.labels("dropped").inc(dropped)

    def admin_evicted(self, blocks: int) -> None:
        """An admin command evicted ``blocks``; its other moves are not counted."""
        self.metrics.evictions.inc(blocks)
        self.skip_cache_moves()

    def skip_cache_moves(self) -> None:
        """Take the pool's totals as they are now (an admin command's lookups and hits are no
        traffic); what it wrote to or dropped from the tiers is counted now, not at the next
        step."""
        self._last = self._manager.stats()
        self.tiers_moved()
