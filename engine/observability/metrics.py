"""Prometheus metrics owned by the engine; names mirror vLLM's with a ``prefixcache:`` prefix."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# No *_created series (one per counter and histogram, and labelled child): scrapers do not
# need them and vLLM turns them off too.
disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip


class GaugeValues(NamedTuple):
    running: int
    waiting: int
    in_use: int
    cached_idle: int
    free: int
    tier_used: int = 0  # bytes of the KV tier (0 without one)
    tier_free: int = 0
    local_held: int = 0  # a hybrid model's local pages (sliding layers), by state
    local_idle: int = 0
    local_free: int = 0


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prefix_cache_queries = Counter(
            "prefixcache:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "prefixcache:prefix_cache_hits",
            "Prompt tokens served from the prefix cache, by where their KV was: pool, or the "
            "KV tier (host, disk) it was copied back from.",
            ["tier"],
            registry=r,
        )
        self.reuse_anywhere_segments = Counter(
            "prefixcache:reuse_anywhere_segments",
            "reuse=anywhere segments placed at a new offset (position-independent reuse), by "
            "where their KV came from: stored (a chunk hit), computed (computed on its own "
            "for this request).",
            ["source"],
            registry=r,
        )
        self.reuse_anywhere_tokens = Counter(
            "prefixcache:reuse_anywhere_tokens",
            "Prompt tokens of placed segments by how they were served: placed (stored KV, "
            "re-rotated), recomputed (repair tokens and the chunk's tail, computed in place).",
            ["served"],
            registry=r,
        )
        self.kv_tier_bytes = Gauge(
            "prefixcache:kv_tier_bytes",
            "Bytes of the KV tier (--kv-offload) by state: used, free.",
            ["state"],
            registry=r,
        )
        self.kv_tier_writes = Counter(
            "prefixcache:kv_tier_writes", "Evicted KV blocks written to the KV tier.", registry=r
        )
        self.kv_tier_reloads = Counter(
            "prefixcache:kv_tier_reloads", "KV blocks copied back from the KV tier.", registry=r
        )
        self.kv_tier_drops = Counter(
            "prefixcache:kv_tier_drops",
            "KV tier entries dropped (its LRU, a refused write, a failed checksum).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "prefixcache:prompt_tokens", "Prompt tokens of finished admissions.", registry=r
        )
        self.prompt_tokens_computed = Counter(
            "prefixcache:prompt_tokens_computed", "Prompt tokens whose KV was computed.", registry=r
        )
        self.generation_tokens = Counter(
            "prefixcache:generation_tokens", "Generated tokens.", registry=r
        )
        self.evictions = Counter(
            "prefixcache:kv_block_evictions", "Cached KV blocks evicted.", registry=r
        )
        self.preemptions = Counter(
            "prefixcache:num_preemptions", "Requests preempted for lack of KV blocks.", registry=r
        )
        self.requests_finished = Counter(
            "prefixcache:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.requests_failed = Counter(
            "prefixcache:request_failure",
            "Requests ended by an error (not counted as finished or aborted), by reason: "
            "request_error (its own sampling or output), engine_error (its batch's model step).",
            ["reason"],
            registry=r,
        )
        self.requests_running = Gauge(
            "prefixcache:num_requests_running", "Requests in the running batch.", registry=r
        )
        self.requests_waiting = Gauge(
            "prefixcache:num_requests_waiting", "Requests waiting to be admitted.", registry=r
        )
        self.kv_blocks = Gauge(
            "prefixcache:kv_blocks",
            "KV blocks by state: in_use (held by requests), cached_idle (reusable, evictable), free.",
            ["state"],
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "prefixcache:kv_cache_usage_perc",
            "Fraction (0-1) of the KV pool's blocks held by requests: vLLM's kv_cache_usage_perc, "
            "what load-aware routers read (cached idle blocks count as free: evictable).",
            registry=r,
        )
        self.model_info = Gauge(
            "prefixcache:model_info",
            "The served model and the dtype its weights and KV cache use (value 1).",
            ["model", "dtype"],
            registry=r,
        )
        self.ttft = Histogram(
            "prefixcache:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "prefixcache:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "prefixcache:engine_step_seconds",
            "Wall time of one engine step (schedule, forward, sample), by kind: 'decode' when "
            "every scheduled sequence computes its last sampled token, else 'prefill'.",
            ["kind"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "prefixcache:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )

    def count_local_tier(self) -> Counter:
        """A hybrid model's tier: its sliding-layer pages' moves (no such series else)."""
        return Counter(
            "prefixcache:kv_tier_local_pages",
            "A hybrid model's sliding-layer KV pages moved by the KV tier: written, reloaded "
            "(a hit's window refilled), dropped.",
            ["event"],
            registry=self.registry,
        )

    def read_gauges_from(
        self, values: Callable[[], GaugeValues], local_pages: bool = False
    ) -> None:
        """The gauges read ``values()`` whenever they are collected, so they are never stale
        (after an abort, an error or a cache command as after a step). ``local_pages``: a
        hybrid model's, exported as ``prefixcache:kv_local_pages`` (no such series else)."""
        if local_pages:
            local = Gauge(
                "prefixcache:kv_local_pages",
                "A hybrid model's sliding-layer KV pages by state: held (inside a running "
                "sequence's window), idle (attached to a cached block, evictable), free.",
                ["state"],
                registry=self.registry,
            )
            local.labels("held").set_function(lambda: values().local_held)
            local.labels("idle").set_function(lambda: values().local_idle)
            local.labels("free").set_function(lambda: values().local_free)
        self.requests_running.set_function(lambda: values().running)
        self.requests_waiting.set_function(lambda: values().waiting)
        self.kv_blocks.labels("in_use").set_function(lambda: values().in_use)
        self.kv_blocks.labels("cached_idle").set_function(lambda: values().cached_idle)
        self.kv_blocks.labels("free").set_function(lambda: values().free)
        self.kv_cache_usage.set_function(lambda: _usage(values()))
        self.kv_tier_bytes.labels("used").set_function(lambda: values().tier_used)
        self.kv_tier_bytes.labels("free").set_function(lambda: values().tier_free)


def _usage(v: GaugeValues) -> float:
    total = v.in_use + v.cached_idle + v.free
    return v.in_use / total if total else 0.0
