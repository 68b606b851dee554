"""Route mode's active health: each upstream's own ``/health`` (at its root, beside its /v1),
asked when this sidecar's ``/health`` is, at most once per interval each.

Routing alone learns of a dead upstream only when a request fails on it (the pool's passive
marking); a load balancer polling this sidecar's ``/health`` would hear "ok" while every
upstream is gone. A probe that fails to connect or gets a 5xx marks the upstream down as a
failed request does; one that gets an answer below 500 clears an earlier mark, so a
restarted upstream takes traffic again without waiting out ``retry_after_s``. A probe that
connects but times out changes nothing: a busy upstream is not a gone one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import anyio
import httpx

from .pool import Upstream, UpstreamPool

log = logging.getLogger("prefixcache.sidecar.upstream")


class HealthProbe:
    def __init__(
        self,
        pool: UpstreamPool,
        on_down: Callable[[Upstream, str], None],
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.pool = pool
        self.on_down = on_down  # a connection failure: marked down and counted, as a request's
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._asked_at: dict[str, float] = {}

    def due(self) -> list[Upstream]:
        """Upstreams not asked within the interval (every one at first)."""
        now = self.pool.clock()
        return [
            u
            for u in self.pool.upstreams
            if now - self._asked_at.get(u.url, -float("inf")) >= self.interval_s
        ]

    async def refresh(self, client: httpx.AsyncClient, headers: Mapping[str, str]) -> None:
        """Ask every due upstream at once; returns when all have answered or timed out."""
        due = self.due()
        now = self.pool.clock()
        for upstream in due:
            self._asked_at[upstream.url] = now
        async with anyio.create_task_group() as group:
            for upstream in due:
                group.start_soon(self._ask, client, headers, upstream)

    async def _ask(
        self, client: httpx.AsyncClient, headers: Mapping[str, str], upstream: Upstream
    ) -> None:
        url = upstream.url.removesuffix("/v1") + "/health"
        try:
            response = await client.get(url, headers=headers, timeout=self.timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.on_down(upstream, type(exc).__name__)
            return
        except httpx.HTTPError:  # connected but slow or cut: busy, not gone; routing decides
            return
        if response.status_code >= 500:
            self.pool.mark_down(upstream)
            log.warning("upstream %s: /health answered %d", upstream.url, response.status_code)
        else:
            self.pool.mark_up(upstream)
