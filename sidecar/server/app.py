"""Engine mode: the Starlette app over an ``EngineAPI``, wiring the request gate, the
generation routes, the cache admin routes and the shared app set-up (http/base_app.py).

``create_app(engine, settings)`` takes any ``EngineAPI`` (engine/api.py), so tests can inject
one. Every check runs before the engine sees a request: auth, readiness, body size, JSON types,
prompt rendering, context length, queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixcache.engine.api import EngineAPI
from prefixcache.engine.serving.errors import EngineStartError

from ..anthropic.routes import MessagesRoutes
from ..http.base_app import build_app, health_reply, metrics_reply, openai_routes
from ..responses_api.routes import ResponsesRoutes
from ..wire import reply_types as rt
from .admission import Admission
from .cache_routes import CacheRoutes
from .dashboard import DashboardRoutes
from .gate import RequestGate
from .generation import GenerationRoutes
from .responses import json_response
from .settings import SidecarSettings
from .tokenize_routes import TokenizeRoutes

__all__ = ["Sidecar", "SidecarSettings", "create_app"]

log = logging.getLogger("prefixcache.sidecar")


def create_app(engine: EngineAPI, settings: SidecarSettings | None = None) -> Starlette:
    sidecar = Sidecar(engine, settings or SidecarSettings())
    app = build_app(sidecar.routes(), sidecar.metrics_registry, sidecar.lifespan)
    app.state.sidecar = sidecar
    return app


class Sidecar:
    def __init__(self, engine: EngineAPI, settings: SidecarSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.gate = RequestGate(engine, settings)
        self.admission = Admission(engine, settings.max_waiting, settings.retry_after_s)
        self.generation = GenerationRoutes(engine, self.gate, self.admission, settings)
        self.anthropic = MessagesRoutes(self.generation)
        self.responses = ResponsesRoutes(self.generation)
        self.tokenize = TokenizeRoutes(self.generation)
        self.metrics_registry = CollectorRegistry()  # the HTTP series, the cache files'
        self.cache = CacheRoutes(
            self.generation, settings.cache_dir, settings.secret, self.metrics_registry
        )
        self.dashboard = DashboardRoutes(engine, self.gate)
        self.created = int(time.time())
        self.start_error: str | None = None
        # Called once the engine failed to start: `prefixcache serve` stops the server and
        # exits non-zero (a supervisor restarts or alerts) rather than answer 503 forever.
        self.on_start_failure: Callable[[], None] | None = None
        self.loading_cache = False  # /health says 503 until the start-up cache files are in

    def routes(self) -> list[Route]:
        serving = openai_routes(
            chat_completions=self.generation.chat_completions,
            completions=self.generation.completions,
            health=self.health,
            metrics=self.metrics,
            models=self.models,
            model=self.model,
        )
        other_apis = [
            *self.anthropic.routes(),  # with Anthropic-shaped 404s and 405s under /v1/messages
            Route("/v1/responses", self.responses.create, methods=["POST"]),
        ]
        return [
            *serving[:2],
            *other_apis,
            *serving[2:],
            *self.cache.routes(),
            *self.tokenize.routes(),
            *self.dashboard.routes(),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.dashboard.ensure_watching()  # the cache page's last minutes, from now on
        if not self.settings.manage_engine:
            try:
                yield
            finally:
                await self.dashboard.stop_watching()
            return
        # Start in the background: the server answers /health (503) while the model loads.
        starting = asyncio.create_task(self._start_engine())
        try:
            yield
        finally:
            await self.dashboard.stop_watching()
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await self.engine.shutdown()

    async def _start_engine(self) -> None:
        self.loading_cache = bool(self.settings.load_on_start)
        try:
            await self.engine.start()
            await self.cache.load_files(self.settings.load_on_start)
            # Startup's objects (an in-process engine's model among them) out of the
            # collector's sight: a full collection walking them stalled the event loop for
            # tens of milliseconds whenever one ran.
            gc.collect()
            gc.freeze()
        except Exception as exc:
            if isinstance(exc, EngineStartError):  # its message says it all: one line, once
                self.start_error = str(exc)
                if self.on_start_failure is None:  # else the caller reports it
                    log.error("engine failed to start: %s", exc)
            else:
                self.start_error = f"{type(exc).__name__}: {exc}"
                log.exception("engine failed to start")
            if self.on_start_failure is not None:
                self.on_start_failure()
        finally:
            self.loading_cache = False

    async def health(self, request: Request) -> Response:
        """200 "ok"; 503 while starting (with Retry-After) and for an engine that broke."""
        error = self.engine.error if self.start_error is None else None
        if error is not None:
            return health_reply("failed", error)
        if self.engine.is_ready and not self.loading_cache:
            return health_reply("ok")
        if self.start_error is not None:
            return health_reply("failed", self.start_error)
        status = "loading cache" if self.loading_cache else "starting"
        return health_reply(status, retry_after=str(self.settings.retry_after_s))

    async def metrics(self, request: Request) -> Response:
        return metrics_reply(self.engine.registry, self.metrics_registry)

    async def models(self, request: Request) -> Response:
        """A card per name requests may use, in vLLM's order: the served names first (the
        ``--model`` value where none is given), then the model's own: clients that take the
        first card (guidellm, as a tokenizer id) take what vLLM would show them."""
        self.gate.caller(request)
        names = self.gate.model_names
        return json_response(rt.ModelList(data=[self._model_card(n) for n in names]))

    async def model(self, request: Request) -> Response:
        """OpenAI's retrieve: the card of a name this server answers to, else 404."""
        self.gate.caller(request)
        name = request.path_params["model"] or "?"
        self.gate.check_model(name)
        return json_response(self._model_card(name))

    def _model_card(self, name: str) -> rt.ModelCard:
        engine = self.engine
        return rt.ModelCard(
            name,
            self.created,
            root=engine.model_name,
            max_model_len=engine.max_model_len,
            dtype=engine.dtype,
        )
