"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, for the
errors the rest of the sidecar raises in OpenAI's; the HTTP status stays."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from ..http.errors import APIError

# Anthropic's error types by HTTP status (its API reference's table).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


# Codes Anthropic's clients read from ``error.details.error_code`` (its SDK picks the
# exception class, and its tool runner falls back to sending the whole history on this one).
DETAIL_CODES = frozenset({"thread_unsupported_request"})


def error_body(exc: APIError) -> dict:
    message = exc.message
    if exc.code == "context_length_exceeded":  # Anthropic's words, which its clients match
        message = f"prompt is too long: {message}"
    error = {"type": error_type(exc.status), "message": message}
    if exc.code in DETAIL_CODES:
        error["details"] = {"error_code": exc.code}
    return {"type": "error", "error": error}


def error_response(exc: APIError) -> Response:
    return Response(
        msgspec.json.encode(error_body(exc)),
        status_code=exc.status,
        headers=exc.headers,
        media_type="application/json",
    )
