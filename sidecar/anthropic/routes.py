"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic bodies checked,
turned into chat requests (convert.py) and served by the engine path's own rendering,
admission and tenancy; every error in Anthropic's shape, the 404 and 405 of other paths and
methods under ``/v1/messages`` too.

The API key may come as ``x-api-key`` (the ``anthropic`` client's header) or as a bearer
token; ``anthropic-version`` and ``anthropic-beta`` are accepted and not required.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http.errors import APIError, bad_request, not_found, server_error
from ..http.streaming import ClientGone, SSEResponse, run_until_disconnect
from ..server.generation import GenerationRoutes
from ..server.responses import collect, json_response, server_timing
from ..wire import protocol as p
from . import convert
from . import wire as w
from .errors import error_response
from .replies import new_message_id, stream_events, whole_message

log = logging.getLogger("prefixcache.sidecar")

Endpoint = Callable[[Request], Awaitable[Response | SSEResponse]]

# Every method a client may send: a route over them answers the ones the endpoints do not take.
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"]


def anthropic_errors(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with every error answered in Anthropic's shape (never a bare 500)."""

    async def guarded(request: Request) -> Response | SSEResponse:
        try:
            return await endpoint(request)
        except APIError as exc:
            return error_response(exc)
        except ClientGone:
            raise
        except Exception:
            log.exception("%s failed", request.url.path)
            return error_response(server_error("internal server error"))

    return guarded


class MessagesRoutes:
    def __init__(self, generation: GenerationRoutes) -> None:
        self.generation = generation
        self.gate = generation.gate
        self.messages = anthropic_errors(self._messages)
        self.count_tokens = anthropic_errors(self._count_tokens)
        self._block_size = 0  # the engine's, once it says

    def routes(self) -> list[Route]:
        """The two endpoints, then what the app would otherwise answer in OpenAI's shape: other
        methods on them (405) and other paths under /v1/messages (404)."""
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/messages", _method_not_allowed, methods=_METHODS),
            Route("/v1/messages/count_tokens", _method_not_allowed, methods=_METHODS),
            Route("/v1/messages/{rest:path}", _no_route, methods=_METHODS),
        ]

    @property
    def block_size(self) -> int:
        if not self._block_size:
            self._block_size = self.generation.engine.cache_stats().block_size
        return self._block_size

    async def _messages(self, request: Request) -> Response | SSEResponse:
        gate = self.gate
        tenant = gate.caller(request, accept_x_api_key=True)
        req = await gate.read(request, w.MessagesRequest)
        chat = self._chat_request(req)
        job = await self.generation.chat_job(
            tenant, chat[0], new_message_id(), convert.retention(chat[1])
        )
        if req.stream:
            events = stream_events(job, self.block_size)
            return SSEResponse(events, on_close=job.stream.aclose)
        try:
            result = await run_until_disconnect(collect(job), request.receive)
        finally:
            await job.stream.aclose()
        message = whole_message(
            job,
            result.text,
            result.finish_reason,
            result.usage,
            result.token_ids,
            result.stop_reason,
            self.block_size,
        )
        response = json_response(message)
        if result.timing is not None:
            response.headers["server-timing"] = server_timing(result.timing)
        return response

    async def _count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": n}``: the whole prompt as /v1/messages would render it."""
        gate = self.gate
        tenant = gate.caller(request, accept_x_api_key=True)
        body = await gate.read(request, w.CountTokensRequest)
        fields = {name: getattr(body, name) for name in w.CountTokensRequest.__struct_fields__}
        req = w.MessagesRequest(**fields, max_tokens=1)
        chat_req, _ = self._chat_request(req)
        namespace = gate.namespace(tenant.name, chat_req.cache_salt)
        prompt = await self.generation.render_chat(chat_req, namespace)
        gate.forget(prompt)  # counted, not served: keep nothing of it
        return json_response({"input_tokens": len(prompt.token_ids)})

    def _chat_request(
        self, req: w.MessagesRequest
    ) -> tuple[p.ChatCompletionRequest, convert.Conversation]:
        """The checked chat request of ``req``; a 400 for what cannot be served."""
        gate = self.gate
        if req.thread not in (None, False):
            raise APIError(
                400,
                "'thread' is not supported by this server: send the whole conversation",
                param="thread",
                code="thread_unsupported_request",
            )
        try:
            chat = convert.conversation(req)
        except p.Error as exc:
            raise bad_request(str(exc), exc.param) from None
        chat_req = convert.chat_request(req, chat)
        gate.check(p.check_chat, chat_req)
        gate.check_model(req.model)
        return chat_req, chat


async def _method_not_allowed(request: Request) -> Response:
    exc = APIError(405, f"Method {request.method} not allowed; use POST", headers={"Allow": "POST"})
    return error_response(exc)


async def _no_route(request: Request) -> Response:
    return error_response(not_found(f"No route {request.method} {request.url.path[:200]}"))
