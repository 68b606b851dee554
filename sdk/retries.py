"""Which failures are retried and how long to wait before the next try."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

RETRY_STATUS = frozenset({408, 429, 502, 503, 504})
MAX_RETRY_AFTER = 60.0  # seconds; a longer Retry-After is not waited for


def retry_wait(attempt: int, response: httpx.Response | None, base: float) -> float:
    if response is not None:
        after = retry_after(response.headers.get("retry-after"))
        if after is not None and 0.0 <= after <= MAX_RETRY_AFTER:
            return after
    return min(base * 2.0**attempt, 16 * base) * (1.0 - 0.25 * random.random())


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: a number of seconds or an HTTP date."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (when - datetime.now(UTC)).total_seconds()
