"""What both sidecar apps (engine mode and upstream mode) do alike at the HTTP edge: read a
request body under a size limit, decode it with OpenAI-shaped errors, and turn exceptions into
OpenAI error responses."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .errors import APIError, bad_request, from_validation, not_found, server_error, too_large
from .streaming import ClientGone

T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_large(limit) if length.isdigit() else bad_request("invalid Content-Length")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def decode_json(body: bytes, type_: type[T]) -> T:
    """``body`` as ``type_``; malformed JSON, bad UTF-8 or a wrong shape is a 400."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8", code="invalid_utf8") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Malformed JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth limit, reached in any field (ignored ones too)
        raise bad_request("The request body is nested too deeply", code="invalid_json") from None


def exception_handlers() -> dict[Any, Any]:
    """Starlette exception handlers: every failure answers in OpenAI's error shape."""
    return {
        APIError: _api_error,
        HTTPException: _http_error,
        ClientGone: _client_gone,
        Exception: _internal_error,
    }


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return not_found(f"No route {request.method} {request.url.path[:200]}").response()
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    response = APIError(exc.status_code, str(exc.detail), type=error_type).response()
    response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 requires it)
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; the status shows up in metrics


async def _internal_error(request: Request, exc: Exception) -> Response:
    return server_error("internal server error").response()
