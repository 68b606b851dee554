"""Upstream responses on their way back: the ``Exchange`` that holds an upstream's in-flight
count until closed, and the SSE relay that passes on whole events only."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from ..http.errors import APIError
from ..http.streaming import DONE, sse_event
from .pool import Upstream, UpstreamPool

log = logging.getLogger("prefixcache.sidecar.upstream")


@dataclass(slots=True)
class Exchange:
    """An upstream response whose headers have arrived. It holds its upstream's in-flight
    count until ``aclose``."""

    pool: UpstreamPool
    upstream: Upstream
    response: httpx.Response
    closed: bool = False

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", "application/json")

    @property
    def is_event_stream(self) -> bool:
        return self.response.status_code == 200 and self.content_type.startswith(
            "text/event-stream"
        )

    async def aclose(self) -> None:
        """Closing an unfinished response drops its connection: the upstream aborts."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.response.aclose()
        finally:
            self.pool.release(self.upstream)


def upstream_lost() -> APIError:
    return APIError(
        502,
        "the upstream connection was lost mid-response",
        type="server_error",
        code="upstream_disconnected",
    )


async def relay_events(response: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream's SSE events as they arrive, whole ones only (decoded if the upstream
    compressed them); a lost upstream drops its half-sent event and ends with an in-band error."""
    pending = b""
    try:
        async for chunk in response.aiter_bytes():
            pending += chunk
            end = _events_end(pending)
            if end:
                yield pending[:end]
                pending = pending[end:]
        if pending:
            yield pending
    except httpx.TransportError as exc:
        log.warning("upstream stream from %s broke: %r", response.request.url, exc)
        yield sse_event(upstream_lost().body()) + DONE


def _events_end(data: bytes) -> int:
    """Where the last complete SSE event in ``data`` ends (0: none is complete yet)."""
    end = 0
    for separator in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.rfind(separator)
        if at >= 0:
            end = max(end, at + len(separator))
    return end
