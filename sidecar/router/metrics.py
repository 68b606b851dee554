"""Upstream mode's Prometheus series: requests and connect failures per upstream, routing
decisions with predicted and reported cached tokens, KV event lag and subscriber counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from .cache_aware import REASONS, CacheAwareRouter
from .pool import ROUTES, UpstreamPool

# No *_created series (one per counter and histogram, and labelled child): scrapers do not
# need them and vLLM turns them off too.
disable_created_metrics()


class UpstreamMetrics:
    def __init__(self, urls: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "prefixcache:upstream_requests",
            "Requests sent to each upstream, by why it was chosen",
            ["upstream", "route"],
            registry=self.registry,
        )
        self.connect_failures = Counter(
            "prefixcache:upstream_connect_failures",
            "Connections to an upstream that failed before any response byte",
            ["upstream"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "prefixcache:upstream_in_flight",
            "Requests sent to each upstream and not finished",
            ["upstream"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "prefixcache:upstream_healthy",
            "1 unless the upstream is skipped after a connection failure",
            ["upstream"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "prefixcache:routing_decisions",
            "Cache-aware routing decisions, by upstream and reason",
            ["upstream", "reason"],
            registry=self.registry,
        )
        self.predicted_cached = Counter(
            "prefixcache:routing_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen upstream to have cached",
            ["upstream"],
            registry=self.registry,
        )
        self.reported_cached = Counter(
            "prefixcache:routing_reported_cached_tokens",
            "Cached prompt tokens the upstream reported (usage.prompt_tokens_details)",
            ["upstream"],
            registry=self.registry,
        )
        self.event_lag = Histogram(
            "prefixcache:kv_event_lag_seconds",
            "From a KV event batch's timestamp to its arrival here",
            ["upstream"],
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=self.registry,
        )
        self.event_stats = Gauge(
            "prefixcache:kv_event_batches",
            "KV event batches from each upstream: received, missed (gaps), replayed (gaps "
            "filled), unfilled_gaps (index cleared), restarts (numbering started over)",
            ["upstream", "kind"],
            registry=self.registry,
        )
        self.events_live = Gauge(
            "prefixcache:kv_events_live",
            "1 while an upstream's KV events are current (precise routing), else 0",
            ["upstream"],
            registry=self.registry,
        )
        self.index_blocks = Gauge(
            "prefixcache:kv_index_blocks",
            "Blocks the router believes each upstream caches (from its events)",
            ["upstream"],
            registry=self.registry,
        )
        for url in urls:  # every series exists from the start, at 0
            for route in ROUTES:
                self.requests.labels(url, route)
            for reason in REASONS:
                self.decisions.labels(url, reason)
            self.predicted_cached.labels(url)
            self.reported_cached.labels(url)
            self.connect_failures.labels(url)

    def update(self, pool: UpstreamPool, router: CacheAwareRouter | None) -> None:
        """Set the gauges from the pool, before the registry is rendered."""
        for upstream in pool.upstreams:
            self.in_flight.labels(upstream.url).set(upstream.in_flight)
            self.healthy.labels(upstream.url).set(int(pool.is_healthy(upstream)))
        for replica in router.replicas.values() if router is not None else ():
            url, sub = replica.upstream.url, replica.subscriber
            if sub is None or replica.index is None:
                continue
            self.events_live.labels(url).set(int(sub.is_live()))
            self.index_blocks.labels(url).set(len(replica.index))
            st = sub.stats
            for kind, value in (
                ("received", st.batches),
                ("missed", st.missed),
                ("replayed", st.replayed),
                ("unfilled_gaps", st.unfilled_gaps),
                ("restarts", st.restarts),
            ):
                self.event_stats.labels(url, kind).set(value)
