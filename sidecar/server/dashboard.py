"""The live cache page: ``GET /dashboard`` (one self-contained HTML file, dashboard.html),
``GET /v1/cache/tree`` (the folded prefix tree, cache_view.py) and ``GET /v1/cache/live``
(SSE: block states, the KV tier's, token counters and the requests that finished, with miss
reasons).

The hit rate, TTFT and request rate over the last minutes come from an ``ActivityWindow``
that ``watch`` (a task for the app's life) fills from the engine's finished requests each
second, so they are whole however many requests a page load's backlog can carry.

With keys configured the data routes (tree, live) need an admin key, as an ``Authorization``
header only: a key in a URL would be kept by the access log, the browser's history and any
proxy between. The page itself holds no data and loads without one; it asks for the key once,
keeps it in memory and sends it as that header (sidecar/http/redaction.py keeps a ``?key=``
that still arrives out of the logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from prefixcache.engine.api import EngineAPI, RequestRecord
from prefixcache.sdk.cache_stats import BlockStats, CacheStats, TierBlockStats, TokenStats

from ..http.errors import bad_request
from ..http.streaming import SSEResponse, sse_event
from .activity_window import ActivityWindow, WindowBucket
from .cache_view import DEFAULT_MAX_NODES, build_view
from .gate import RequestGate

log = logging.getLogger(__name__)

TREE_MAX_AGE_S = 1.0  # viewers share one fold of the tree per second
BACKLOG = 500  # records in a new stream's first event (the last misses)
POLL_S = 1.0  # the window's poll of the engine's finished requests


class LiveEvent(msgspec.Struct):
    t: float  # unix time
    blocks: BlockStats
    tier: TierBlockStats | None  # the KV tier below the pool (None: the engine has none)
    tokens: TokenStats
    hit_rate: float  # since start
    tree_version: int  # changes whenever blocks were inserted, evicted, pinned or unpinned
    waiting: int
    requests: list[RequestRecord]  # finished since the last event (the first: the last BACKLOG)
    window: list[WindowBucket]  # the buckets changed since the last event (the first: all)


class DashboardRoutes:
    def __init__(self, engine: EngineAPI, gate: RequestGate) -> None:
        self.engine = engine
        self.gate = gate
        self._tree: tuple[float, tuple[int, int], bytes] | None = None  # (built, key, body)
        self._tree_lock = asyncio.Lock()
        self.window = ActivityWindow()
        self._watching: asyncio.Task[None] | None = None

    async def watch(self) -> None:
        """Count finished requests into the window, every POLL_S, until cancelled."""
        while True:
            try:
                self._poll()
            except Exception:  # the window goes on counting after one bad poll
                log.exception("dashboard: polling the engine's finished requests failed")
            await asyncio.sleep(POLL_S)

    def ensure_watching(self) -> None:
        """Start ``watch`` if the app's lifespan did not (an app sharing another's engine)."""
        if self._watching is None or self._watching.done():
            self._watching = asyncio.get_running_loop().create_task(self.watch())

    async def stop_watching(self) -> None:
        task, self._watching = self._watching, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _poll(self) -> None:
        if self.engine.is_ready:
            self.window.observe(self.engine.cache_activity(self.window.cursor))

    def routes(self) -> list[Route]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/v1/cache/tree", self.tree, methods=["GET"]),
            Route("/v1/cache/live", self.live, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        """The page: no data and no key (it asks for one); it loads while the model does."""
        html = resources.files(__package__).joinpath("dashboard.html").read_text("utf-8")
        headers = {"cache-control": "no-store", "referrer-policy": "no-referrer"}
        return HTMLResponse(html, headers=headers)

    async def tree(self, request: Request) -> Response:
        self._admin(request)
        max_nodes = _int_param(request, "max_nodes", DEFAULT_MAX_NODES, 16, 5000)
        async with self._tree_lock:
            cached = self._tree
            key = (max_nodes, _tree_version(self.engine.cache_stats()))
            # a fold is shared for a second, but never once the tree changed: a viewer told of
            # a new version by /v1/cache/live must not be handed the fold from before it
            if cached is None or time.monotonic() - cached[0] > TREE_MAX_AGE_S or cached[1] != key:
                snap = await self.engine.cache_tree()
                view = await asyncio.to_thread(build_view, snap, max_nodes)
                cached = self._tree = (time.monotonic(), key, msgspec.json.encode(view))
        return Response(cached[2], media_type="application/json")

    async def live(self, request: Request) -> SSEResponse:
        self._admin(request)
        self.ensure_watching()
        interval = _float_param(request, "interval", 1.0, 0.1, 10.0)
        return SSEResponse(self._events(interval))

    async def _events(self, interval: float) -> AsyncIterator[bytes]:
        records = self.engine.cache_activity(0)[-BACKLOG:]
        cursor = records[-1].seq if records else 0
        seen = 0  # the window's version this viewer has
        while self.engine.is_ready:  # ends when the engine shuts down
            self._poll()
            window, seen = self.window.since(seen, time.time()), self.window.version
            stats = self.engine.cache_stats()
            yield sse_event(
                LiveEvent(
                    t=time.time(),
                    blocks=stats.blocks,
                    tier=stats.tier if isinstance(stats.tier, TierBlockStats) else None,
                    tokens=stats.tokens,
                    hit_rate=stats.hit_rate,
                    tree_version=_tree_version(stats),
                    waiting=self.engine.num_waiting,
                    requests=records,
                    window=window,
                )
            )
            await asyncio.sleep(interval)
            records = self.engine.cache_activity(cursor)
            if records:
                cursor = records[-1].seq

    def _admin(self, request: Request) -> None:
        self.gate.settings.keys.authenticate_admin(request.headers.get("authorization"))
        self.gate.require_ready()


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be an integer in [{lo}, {hi}]", name)
    return value


def _float_param(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be a number in [{lo}, {hi}]", name)
    return value


def _tree_version(stats: CacheStats) -> int:
    """Changes whenever blocks were inserted into or evicted from the tree, or the number of
    pinned blocks changed (a TTL pin lapsed, an unpin); within a JavaScript number."""
    key = (stats.tokens.inserted, stats.tokens.evicted, stats.blocks.pinned)
    return hash(key) & (2**53 - 1)
