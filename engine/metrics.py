"""Prometheus metrics owned by the engine; names mirror vLLM's with a ``prefixcache:`` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip


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
            "Prompt tokens served from the prefix cache.",
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
        self.e2e_latency = Histogram(
            "prefixcache:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
