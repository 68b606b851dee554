"""Every error the client raises. All derive from ``PrefixCacheError``.

``APIError`` carries what the server said: ``status_code``, the error JSON's ``type``,
``code`` and ``param``, and the ``response`` itself (``None`` when no response arrived).

    PrefixCacheError
    └── APIError
        ├── APIConnectionError          no response (refused, reset, DNS)
        │   └── APITimeoutError         connect / first token / total deadline passed
        ├── APIStatusError              HTTP 4xx/5xx
        │   ├── BadRequestError         400
        │   ├── AuthenticationError     401
        │   ├── PermissionDeniedError   403
        │   ├── NotFoundError           404
        │   ├── UnprocessableEntityError 422
        │   ├── RateLimitError          429
        │   ├── InternalServerError     500 and other 5xx
        │   └── ServiceUnavailableError 503
        ├── StreamError                 error sent in-band after a stream started
        └── ResponseFormatError         a 2xx response the client could not parse
    UnsupportedError                    the client's backend has no such operation
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx


class PrefixCacheError(Exception):
    """Base class for everything raised by prefixcache.sdk."""


class UnsupportedError(PrefixCacheError):
    """The client's backend has no such operation (e.g. cache admin on a hosted API)."""


class APIError(PrefixCacheError):
    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        error_type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.code = code
        self.param = param
        self.response = response

    def __str__(self) -> str:
        head = f"{self.status_code} " if self.status_code is not None else ""
        kind = f"[{self.error_type}] " if self.error_type else ""
        return f"{head}{kind}{self.message}"


class APIConnectionError(APIError):
    pass


# connect, first_token, total: the Timeouts fields. write, pool: sending the body or waiting
# for a pooled connection took longer than ``connect``. read: a transport's own read limit.
TimeoutKind = Literal["connect", "first_token", "total", "write", "pool", "read"]


class APITimeoutError(APIConnectionError):
    def __init__(self, message: str, *, kind: TimeoutKind) -> None:
        super().__init__(message, error_type="timeout", code=kind)
        self.kind: TimeoutKind = kind


class APIStatusError(APIError):
    pass


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


class ServiceUnavailableError(InternalServerError):
    pass


class StreamError(APIError):
    pass


class ResponseFormatError(APIError):
    pass


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def parse_error_body(body: Any) -> dict[str, Any]:
    """The fields of an error JSON: OpenAI's ``{"error": {...}}`` and common variants."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, str):
            return {"message": err}
        if isinstance(err, dict):
            message = err.get("message") or err.get("detail") or body.get("detail")
            if message is not None and not isinstance(message, str):
                message = json.dumps(message)  # FastAPI's validation list, say
            return {
                "message": message,  # None: the caller falls back to the body text
                "type": _opt_str(err.get("type")),
                "code": _opt_str(err.get("code")),
                "param": _opt_str(err.get("param")),
            }
    return {}


def status_error(response: httpx.Response) -> APIStatusError:
    """The typed exception for an HTTP error response (its body must have been read)."""
    try:
        fields = parse_error_body(response.json())
    except ValueError:
        fields = {}
    message = fields.get("message") or response.text.strip() or response.reason_phrase
    status = response.status_code
    cls = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    return cls(
        message,
        status_code=status,
        error_type=fields.get("type"),
        code=fields.get("code"),
        param=fields.get("param"),
        response=response,
    )


def stream_error(payload: dict[str, Any], response: httpx.Response) -> StreamError:
    fields = parse_error_body(payload)
    return StreamError(
        fields.get("message") or "error in stream",
        status_code=response.status_code,
        error_type=fields.get("type"),
        code=fields.get("code"),
        param=fields.get("param"),
        response=response,
    )


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)
