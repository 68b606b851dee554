"""Every response names its request: ``x-request-id`` (OpenAI's header, which its client reads
as ``request_id``) and ``request-id`` (Anthropic's), one id, as a pure ASGI middleware.

A client's or proxy's own ``x-request-id`` is echoed (if short and printable), so logs on both
sides meet; else the id is ``req_`` and 32 hex digits. A response that already names one (a
relayed upstream reply) keeps its own. The id is also the request's ``CURRENT_ID`` while it is
served, which ``RequestIdFilter`` puts on log records (uvicorn's access line ends with it).
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar
from typing import Any

from .streaming import Receive, Send

ASGIApp = Any
_GIVEN = re.compile(rb"[\x21-\x7e]{1,128}")
_NAMES = (b"x-request-id", b"request-id")
CURRENT_ID: ContextVar[str] = ContextVar("prefixcache_request_id", default="-")


class RequestIdFilter(logging.Filter):
    """``record.request_id``: the id of the request being served where the record was made
    ("-" outside one), for a format's ``%(request_id)s``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = CURRENT_ID.get()
        return True


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = given if given and _GIVEN.fullmatch(given) else f"req_{uuid.uuid4().hex}".encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {k.lower() for k, _ in headers}
                headers += [(name, rid) for name in _NAMES if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        token = CURRENT_ID.set(rid.decode("ascii"))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT_ID.reset(token)
