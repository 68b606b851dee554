"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Messages describe what was wrong, never echo the request body.
"""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

_ENUM_VALUE = re.compile(r"Invalid enum value .*? - at")


class APIError(Exception):
    """Raised anywhere in a handler; turned into an error response by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# OpenAI's names this server parses but does not serve, by the field they fill: a refusal
# that names them (they are this list's words, not the body's, so naming them echoes nothing).
_UNSERVED = {
    "type": {
        "image_url": "image content parts are not supported: the model takes text only",
        "input_audio": "audio content parts are not supported: the model takes text only",
        "file": "file content parts are not supported: send the file's text as a text part",
        "refusal": "refusal content parts are not supported: send the refusal as text",
        "custom": "custom tools are not supported, only function tools",
        "allowed_tools": "tool_choice 'allowed_tools' is not supported: send only those tools",
    },
    "role": {"function": "the legacy 'function' role is not supported: use 'tool' messages"},
}
_ENUM_AT = re.compile(r"Invalid enum value '([a-z_]+)' - at `\$\.(.*)`$")


def from_validation(exc: msgspec.ValidationError) -> APIError:
    """msgspec names the JSON path; drop any echoed value (enum values come from the body),
    except an OpenAI name this server does not serve, which is said plainly."""
    known = _ENUM_AT.match(str(exc))
    if known is not None:
        value, path = known.groups()
        what = _UNSERVED.get(path.rsplit(".", 1)[-1], {}).get(value)
        if what is not None:
            return APIError(400, what, param=path, code="invalid_value")
    message = _ENUM_VALUE.sub("Invalid value - at", str(exc))
    param = None
    if " - at `$." in message:
        param = message.rsplit(" - at `$.", 1)[1].rstrip("`")
    return APIError(400, f"Invalid request: {message}", param=param, code="invalid_value")


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, type="not_found_error", code=code)


def model_not_found(served: str) -> APIError:
    """OpenAI's shape for an unknown model: an invalid request, HTTP 404."""
    return APIError(
        404,
        f"The model does not exist; this server serves '{served}'",
        param="model",
        code="model_not_found",
    )


def unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def forbidden(message: str) -> APIError:
    return APIError(403, message, type="permission_error", code="forbidden")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes", code="request_too_large")


def overloaded(retry_after: int) -> APIError:
    return APIError(
        429,
        "The server's waiting queue is full; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def not_ready(retry_after: int) -> APIError:
    return APIError(
        503,
        "The engine is not ready yet",
        type="service_unavailable",
        code="engine_not_ready",
        headers={"Retry-After": str(retry_after)},
    )


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
