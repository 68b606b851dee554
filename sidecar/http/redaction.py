"""No secret in a log line: query values of secret-looking names (``key``, ``api_key``,
``token``, ``secret``, ``password``, ...) are replaced by ``[redacted]`` in every record that
uvicorn's handlers (the access log above all) or the root handler write.

Nothing of this server puts a key in a URL any more (the cache page sends it as a header), but
a client may still send one (an old bookmark of ``/dashboard?key=...``): the access log line
then reads ``GET /dashboard?key=[redacted]``.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

REDACTED = "[redacted]"
# a query parameter (after ? & or ;) whose name ends in one of these; its value up to the next
# separator, quote, space or fragment
_SECRET_QUERY = re.compile(
    r"([?&;][^=&;?\s\"'#]*(?:key|token|secret|password|passwd|authorization)=)[^&;\s\"'#]*",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with the value of every secret-looking query parameter replaced."""
    if "=" not in text:
        return text
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, text)


class RedactSecrets(logging.Filter):
    """A handler filter: redacts the record's message and its string arguments in place (the
    access log's request path is one of its arguments)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redacted(v) for k, v in record.args.items()}
        return True


def _redacted(arg: object) -> object:
    """A log argument, or its text redacted where that changes it (a URL object too)."""
    if arg is None or isinstance(arg, int | float):
        return arg
    text = arg if isinstance(arg, str) else str(arg)
    clean = redact(text)
    return arg if clean == text else clean


def redacted_log_config() -> dict[str, Any]:
    """uvicorn's logging configuration with ``RedactSecrets`` on each of its handlers, and
    each access line ending with the request's id (its response's ``x-request-id``)."""
    from uvicorn.config import LOGGING_CONFIG

    from .request_ids import RequestIdFilter

    config = copy.deepcopy(LOGGING_CONFIG)
    filters = config.setdefault("filters", {})
    filters["redact_secrets"] = {"()": RedactSecrets}
    filters["request_id"] = {"()": RequestIdFilter}
    for handler in config.get("handlers", {}).values():
        handler["filters"] = [*handler.get("filters", []), "redact_secrets", "request_id"]
    config["formatters"]["access"]["fmt"] += " %(request_id)s"
    return config


def redact_root_handlers() -> None:
    """``RedactSecrets`` on the root logger's handlers (``logging.basicConfig``'s)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactSecrets) for f in handler.filters):
            handler.addFilter(RedactSecrets())
