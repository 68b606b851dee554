"""HTTP metrics as a pure ASGI middleware: requests by route and status, latency histogram.

The route label is the route's path when it is one of ours, else ``other``, so that scanners
probing random paths cannot blow up the label set.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from .streaming import Receive, Send

# No *_created series (one per counter and histogram, and labelled child): scrapers do not
# need them and vLLM turns them off too.
disable_created_metrics()

ASGIApp = Any

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class HTTPMetrics:
    def __init__(self, app: ASGIApp, paths: Iterable[str], registry: CollectorRegistry) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.requests = Counter(
            "prefixcache:http_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "prefixcache:http_request_duration_seconds",
            "Time from request start to the end of the response (streams included)",
            ["route"],
            buckets=_BUCKETS,
            registry=registry,
        )

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.paths else "other"
        status = 500  # if the app raises before answering
        start = time.perf_counter()

        async def send_and_record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.requests.labels(route, scope["method"], str(status)).inc()
            self.latency.labels(route).observe(time.perf_counter() - start)
