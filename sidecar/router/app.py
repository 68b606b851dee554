"""Upstream mode: the sidecar as a cache-aware router in front of OpenAI-compatible servers.

``create_upstream_app(settings)`` proxies /v1/chat/completions and /v1/completions to the
upstream the routing policy chooses: ``cache_aware`` (router/cache_aware.py: precise over the
upstreams' KV events, approximate over a tree of what was sent where) or ``hash``
(router/pool.py: bounded-load rendezvous hashing of the request's affinity key). Bodies are forwarded as
they came, except that a chat body with ``segments`` becomes plain ``messages`` (upstreams do
not know segments). Statuses, bodies and content types come back unchanged; SSE streams are
relayed as their bytes arrive. A connection that fails before any response byte marks its
upstream down and the request moves to the next choice; nothing is retried once the
upstream has answered. vLLM's /tokenize and /detokenize go to the first healthy upstream;
its /reset_prefix_cache (admin key) to every healthy one. Its metrics: metrics.py; one
request's routing bookkeeping: routed.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..chat.rendering import ChatTokenizer
from ..http.base_app import build_app, health_reply, metrics_reply, openai_routes
from ..http.errors import APIError
from ..http.io import read_body
from ..http.streaming import SSEResponse, run_until_disconnect
from ..http.tenancy import KeyStore
from ..wire import reply_types as rt
from .bodies import decode_object, segments_to_messages
from .cache_aware import CacheAwareRouter, Replica, RoutingSettings
from .health_probe import HealthProbe
from .kv_index import ReplicaIndex
from .kv_subscriber import EventSubscriber
from .metrics import UpstreamMetrics
from .pool import Upstream, UpstreamPool, affinity_key
from .relay import Exchange, relay_events, upstream_lost
from .route_input import RouteInput, RouteReader
from .routed import Routed

log = logging.getLogger("prefixcache.sidecar.upstream")

# Failures before any response byte: the request never ran there, so another upstream may
# take it. (ReadError/RemoteProtocolError here: the connection dropped before the headers.)
CONNECT_FAILURES: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


@dataclass(slots=True, frozen=True)
class EventSource:
    endpoint: str  # the upstream's KV event PUB socket, e.g. tcp://10.0.0.7:5557
    replay_endpoint: str | None = None  # its ROUTER replay socket


@dataclass(slots=True)
class UpstreamSettings:
    upstreams: tuple[str, ...]  # base URLs, e.g. ("http://10.0.0.7:8000/v1", ...)
    routing: str = "cache_aware"  # cache_aware | hash
    events: dict[str, EventSource] = field(default_factory=dict)  # by upstream URL
    tokenizer: ChatTokenizer | None = None  # the upstreams' model's, for precise routing
    cache_aware: RoutingSettings = field(default_factory=RoutingSettings)
    keys: KeyStore = field(default_factory=KeyStore)  # who may call this sidecar
    upstream_api_key: str | None = None  # sent upstream as "Authorization: Bearer ..."
    load_factor: float = 1.25
    min_load: int = 8  # in flight below which an upstream always takes its own keys
    retry_after_s: float = 5.0  # how long an unreachable upstream is skipped
    timeout_s: float = 600.0  # longest wait for any upstream read (a stream's next chunk too)
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024


def create_upstream_app(settings: UpstreamSettings) -> Starlette:
    proxy = UpstreamProxy(settings)
    routes = openai_routes(
        chat_completions=proxy.chat_completions,
        completions=proxy.completions,
        health=proxy.health,
        metrics=proxy.metrics_text,
        models=proxy.models,
        model=proxy.models,  # proxied as asked: the upstream answers both
    )
    routes += [
        Route("/tokenize", proxy.tokenization, methods=["POST"]),
        Route("/detokenize", proxy.tokenization, methods=["POST"]),
        Route("/tokenizer_info", proxy.tokenization, methods=["GET"]),
        Route("/reset_prefix_cache", proxy.reset_prefix_cache, methods=["POST"]),
    ]
    app = build_app(routes, proxy.metrics.registry, proxy.lifespan)
    app.state.upstream = proxy
    return app


class UpstreamProxy:
    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings
        self.pool = UpstreamPool(
            settings.upstreams,
            settings.load_factor,
            settings.retry_after_s,
            min_load=settings.min_load,
        )
        self.metrics = UpstreamMetrics([u.url for u in self.pool.upstreams])
        if settings.routing not in ("cache_aware", "hash"):
            raise ValueError(f"routing must be cache_aware or hash, not {settings.routing!r}")
        self.reader = RouteReader(settings.tokenizer)
        self.router: CacheAwareRouter | None = None
        if settings.routing == "cache_aware":
            self.router = CacheAwareRouter(
                self.pool, self._replicas(settings), settings.cache_aware
            )
        self.upstream_headers = {"accept-encoding": "identity"}  # relay bytes as sent
        if settings.upstream_api_key:
            self.upstream_headers["authorization"] = f"Bearer {settings.upstream_api_key}"
        self._client: httpx.AsyncClient | None = None
        self.probe = HealthProbe(
            self.pool, self._mark_down, timeout_s=min(2.0, settings.connect_timeout_s)
        )

    def _replicas(self, settings: UpstreamSettings) -> list[Replica]:
        events = {url.rstrip("/"): source for url, source in settings.events.items()}
        unknown = set(events) - {u.url for u in self.pool.upstreams}
        if unknown:
            raise ValueError(f"events given for unknown upstreams: {sorted(unknown)}")
        replicas = []
        for upstream in self.pool.upstreams:
            replica = Replica(upstream)
            if (source := events.get(upstream.url)) is not None:
                replica.index = ReplicaIndex()
                replica.subscriber = EventSubscriber(
                    source.endpoint,
                    replica.index,
                    source.replay_endpoint,
                    stale_after_s=settings.cache_aware.stale_after_s,
                    on_lag=self.metrics.event_lag.labels(upstream.url).observe,
                )
            replicas.append(replica)
        return replicas

    def _subscribers(self) -> list[EventSubscriber]:
        if self.router is None:
            return []
        return [r.subscriber for r in self.router.replicas.values() if r.subscriber is not None]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        for subscriber in self._subscribers():
            subscriber.start()
        try:
            async with self._http_client():
                yield
        finally:
            for subscriber in self._subscribers():
                subscriber.stop()

    @contextlib.asynccontextmanager
    async def _http_client(self) -> AsyncIterator[None]:
        timeout = httpx.Timeout(self.settings.timeout_s, connect=self.settings.connect_timeout_s)
        # No connection cap: the upstreams queue; the load bound already spreads the work.
        # Idle connections expire before the upstreams' own keep-alive (uvicorn's is 5 s), so
        # a reused one is never one the upstream is closing (which would mark it down).
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
        )
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the upstream client exists only while the app runs")
        return self._client

    # --- plain routes ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        await self.probe.refresh(self.client, self.upstream_headers)
        if self.pool.healthy():
            return health_reply("ok")
        return health_reply("unavailable", "no upstream reachable", self._retry_after())

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.update(self.pool, self.router)
        return metrics_reply(self.metrics.registry)

    async def models(self, request: Request) -> Response:
        """Proxied from the first healthy upstream, in configuration order."""
        self.settings.keys.authenticate(request.headers.get("authorization"))
        path = request.url.path.removeprefix("/v1")
        for upstream in self.pool.healthy():
            if (exchange := await self._connect(upstream, "GET", path, None)) is not None:
                return await self._buffered(exchange, request)
        raise self._no_upstream()

    async def tokenization(self, request: Request) -> Response:
        """vLLM's /tokenize, /detokenize and /tokenizer_info (at an upstream's root, beside its
        /v1), proxied to the first healthy upstream: every replica serves the same model and
        tokenizer."""
        self.settings.keys.authenticate(request.headers.get("authorization"))
        payload = await read_body(request, self.settings.max_body_bytes)
        for upstream in self.pool.healthy():
            exchange = await self._connect(
                upstream, request.method, request.url.path, payload or None, root=True
            )
            if exchange is not None:
                return await self._buffered(exchange, request)
        raise self._no_upstream()

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's reset, sent to every healthy upstream's root at once with the query (and any
        body) as given: each upstream checks its own parameters. 200 with each upstream's
        answer and ``success`` when all succeeded; 502 when none could be reached. An upstream
        that reset loses its marks in the approximate tree (its event index follows its own
        events: vLLM's AllBlocksCleared, or what this project's engine evicted)."""
        self.settings.keys.authenticate_admin(request.headers.get("authorization"))
        payload = await read_body(request, self.settings.max_body_bytes)
        path = "/reset_prefix_cache" + (f"?{request.url.query}" if request.url.query else "")
        healthy = self.pool.healthy()
        sent = await asyncio.gather(
            *(self._reset_one(upstream, path, payload or None) for upstream in healthy)
        )
        if not any(answer.status is not None for answer in sent):
            raise self._no_upstream()
        by_url = {answer.url: answer for answer in sent}
        answers = [  # in configuration order; a down one did not reset: its cache may be there
            by_url.get(u.url) or rt.UpstreamReset(u.url, None, False) for u in self.pool.upstreams
        ]
        for answer in answers:
            if answer.success and self.router is not None:
                self.router.forget(answer.url)
        success = all(answer.success for answer in answers)
        log.info("prefix cache reset sent to %d upstreams: success %s", len(healthy), success)
        return Response(
            msgspec.json.encode(rt.RouterResetResponse(success, answers)),
            media_type="application/json",
        )

    async def _reset_one(
        self, upstream: Upstream, path: str, payload: bytes | None
    ) -> rt.UpstreamReset:
        try:
            response = await self._send(upstream, "POST", path, payload, root=True)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        except CONNECT_FAILURES as exc:
            self._mark_down(upstream, type(exc).__name__)
            return rt.UpstreamReset(upstream.url, None, False)
        except httpx.TransportError as exc:  # a timeout, or the answer cut
            log.warning("upstream %s: no answer to the reset (%r)", upstream.url, exc)
            return rt.UpstreamReset(upstream.url, None, False)
        return rt.UpstreamReset(upstream.url, response.status_code, _reset_done(response, content))

    # --- generation -----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        self.settings.keys.authenticate(request.headers.get("authorization"))
        payload = await read_body(request, self.settings.max_body_bytes)
        body = decode_object(payload)
        key = affinity_key(body)  # before the rewrite: it needs the stability classes
        if "segments" in body:
            body = segments_to_messages(body)
            payload = msgspec.json.encode(body)
        route = self.reader.chat(body) if self.router is not None else None
        return await self._proxy(request, "/chat/completions", payload, key, body, route)

    async def completions(self, request: Request) -> Response | SSEResponse:
        self.settings.keys.authenticate(request.headers.get("authorization"))
        payload = await read_body(request, self.settings.max_body_bytes)
        body = decode_object(payload)
        route = self.reader.completion(body) if self.router is not None else None
        return await self._proxy(request, "/completions", payload, affinity_key(body), body, route)

    async def _proxy(
        self,
        request: Request,
        path: str,
        payload: bytes,
        key: bytes,
        body: dict[str, Any],
        route: RouteInput | None,
    ) -> Response | SSEResponse:
        opened = await run_until_disconnect(self._open(path, payload, key, route), request.receive)
        exchange, routed = opened
        if body.get("stream") is True and exchange.is_event_stream:
            headers = {"content-type": exchange.content_type}

            async def close() -> None:
                try:
                    await exchange.aclose()
                finally:
                    routed.finish()

            return SSEResponse(
                routed.watch(relay_events(exchange.response)), on_close=close, headers=headers
            )
        # Anything else, a 429 or 503 with its Retry-After too, comes back whole.
        try:
            response = await self._buffered(exchange, request)
            routed.first_byte()
            routed.report(response.body)
            return response
        finally:
            routed.finish()

    async def _open(
        self, path: str, payload: bytes, key: bytes, route: RouteInput | None
    ) -> tuple[Exchange, Routed]:
        """The response headers of the first choice that accepts the connection."""
        tried: set[str] = set()
        while True:
            decision = None
            if self.router is not None and route is not None:
                decision = self.router.choose(route.text, route.token_ids, exclude=tried)
                upstream = decision.upstream if decision is not None else None
            else:
                choice = self.pool.choose(key, exclude=tried)
                upstream = choice.upstream if choice is not None else None
                if choice is not None:
                    self.metrics.requests.labels(choice.upstream.url, choice.route).inc()
            if upstream is None:
                raise self._no_upstream()
            token_ids = route.token_ids if route else None
            routed = Routed(self.router, self.metrics, upstream, decision, token_ids)
            exchange = await self._connect(upstream, "POST", path, payload)
            if exchange is not None:
                return exchange, routed
            routed.abandon()
            tried.add(upstream.url)

    async def _connect(
        self, upstream: Upstream, method: str, path: str, payload: bytes | None, root: bool = False
    ) -> Exchange | None:
        """Send and wait for the response headers; None when the connection failed (the
        upstream is then marked down). The Exchange holds the upstream's in-flight count."""
        # Runs before the first await: no request can choose between another's choose and
        # acquire, so each sees the others' in-flight counts.
        self.pool.acquire(upstream)
        opened = False
        try:
            response = await self._send(upstream, method, path, payload, root)
            opened = True
        except CONNECT_FAILURES as exc:
            self._mark_down(upstream, type(exc).__name__)
            return None
        except httpx.TimeoutException:
            raise self._timed_out() from None
        finally:
            if not opened:
                self.pool.release(upstream)
        return Exchange(self.pool, upstream, response)

    async def _send(
        self, upstream: Upstream, method: str, path: str, payload: bytes | None, root: bool = False
    ) -> httpx.Response:
        """``path`` after the upstream's URL (its /v1), or with ``root`` after its host."""
        headers = dict(self.upstream_headers)
        if payload is not None:
            headers["content-type"] = "application/json"
        base = upstream.url.removesuffix("/v1") if root else upstream.url
        request = self.client.build_request(method, base + path, content=payload, headers=headers)
        return await self.client.send(request, stream=True)

    async def _buffered(self, exchange: Exchange, request: Request) -> Response:
        """The whole upstream answer, with its status and content type."""
        try:
            content = await run_until_disconnect(exchange.response.aread(), request.receive)
        except httpx.TimeoutException:
            raise self._timed_out() from None
        except httpx.TransportError as exc:
            log.warning("upstream %s dropped a response: %r", exchange.upstream.url, exc)
            raise upstream_lost() from None
        finally:
            await exchange.aclose()
        headers = {"content-type": exchange.content_type}
        if retry_after := exchange.response.headers.get("retry-after"):
            headers["retry-after"] = retry_after  # the upstream's backoff, for the client's
        return Response(content, exchange.response.status_code, headers=headers)

    def _mark_down(self, upstream: Upstream, reason: str) -> None:
        self.pool.mark_down(upstream)
        self.metrics.connect_failures.labels(upstream.url).inc()
        log.warning(
            "upstream %s unreachable (%s); skipped for %.1fs",
            upstream.url,
            reason,
            self.settings.retry_after_s,
        )

    def _retry_after(self) -> str:
        return str(max(1, math.ceil(self.settings.retry_after_s)))

    def _no_upstream(self) -> APIError:
        return APIError(
            502,
            "no upstream reachable",
            type="server_error",
            code="upstream_unreachable",
            headers={"Retry-After": self._retry_after()},
        )

    def _timed_out(self) -> APIError:
        return APIError(
            504,
            f"the upstream sent nothing for {self.settings.timeout_s:g}s",
            type="server_error",
            code="upstream_timeout",
        )


def _reset_done(response: httpx.Response, content: bytes) -> bool:
    """A 200 whose body does not say ``"success": false`` (vLLM's answer while blocks are
    held; an older vLLM answers 200 with no body)."""
    if response.status_code != 200:
        return False
    try:
        body = msgspec.json.decode(content) if content.strip() else {}
    except msgspec.DecodeError:
        return True
    return not (isinstance(body, dict) and body.get("success") is False)
