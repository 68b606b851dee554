"""Request bodies in upstream mode: forwarded as they came, except that a chat body with
``segments`` becomes plain ``messages`` in stability order (upstreams do not know segments)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..http.errors import bad_request, from_validation
from ..http.io import decode_json
from ..wire import protocol as p


def decode_object(payload: bytes) -> dict[str, Any]:
    body = decode_json(payload, object)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    return body


class SegmentsField(msgspec.Struct):
    segments: list[p.Segment]


def segments_to_messages(body: dict[str, Any]) -> dict[str, Any]:
    """The body with ``segments`` replaced by ``messages`` in stability order."""
    rewritten = {name: value for name, value in body.items() if name != "segments"}
    if body["segments"] is None:  # an explicit null: there are no segments
        return rewritten
    try:  # wrapped, so that errors name the path `$.segments[i].field`
        segments = msgspec.convert({"segments": body["segments"]}, SegmentsField).segments
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    messages = body.get("messages")
    try:  # the openai client requires `messages`: segment users send []
        p.check_prompt_source(messages or None, segments)
    except p.Error as exc:
        raise bad_request(str(exc), exc.param) from None
    ordered = p.order_segments(segments)
    rewritten["messages"] = [{"role": s.role, "content": s.content} for s in ordered]
    return rewritten
