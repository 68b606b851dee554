"""The Starlette app both modes build (engine mode, server/app.py; upstream mode, router/app.py):
the OpenAI routes in one order, the HTTP metrics middleware, the OpenAI-shaped exception
handlers, and the /health and /metrics replies."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .io import exception_handlers
from .metrics import HTTPMetrics
from .request_ids import RequestIds

Endpoint = Callable[[Request], Awaitable[Any]]
Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]


def openai_routes(
    *,
    chat_completions: Endpoint,
    completions: Endpoint,
    health: Endpoint,
    metrics: Endpoint,
    models: Endpoint,
    model: Endpoint,
) -> list[Route]:
    return [  # matched in order: the hot routes first
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
    ]


def build_app(
    routes: Sequence[Route], registry: CollectorRegistry, lifespan: Lifespan
) -> Starlette:
    """The app over ``routes``; HTTP metrics (labelled by these routes' paths) go to
    ``registry``."""
    paths = [route.path for route in routes]
    return Starlette(
        routes=list(routes),
        middleware=[
            Middleware(HTTPMetrics, paths=paths, registry=registry),
            Middleware(RequestIds),
        ],
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )


def health_reply(status: str, error: str | None = None, retry_after: str | None = None) -> Response:
    """200 for "ok", else 503 with the reason (and when to ask again, if known)."""
    body = {"status": status} if error is None else {"status": status, "error": error}
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    return JSONResponse(body, 200 if status == "ok" else 503, headers=headers)


def metrics_reply(*registries: CollectorRegistry) -> Response:
    """The Prometheus text of every registry, in order."""
    body = b"".join(generate_latest(registry) for registry in registries)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
