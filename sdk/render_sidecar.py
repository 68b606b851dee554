"""The prefixcache sidecar's segment request (see the wire contract in docs/sdk.md)."""

from __future__ import annotations

from typing import Any

from .segment import PromptParts, tools_segment
from .stability import class_ends


def render_segments(prompt: PromptParts, ttl: str | None = None) -> list[dict[str, Any]]:
    """The ``segments`` list, already in render order (the sidecar orders them the same way).

    The sidecar has no ``tools`` field: tool schemas go first, as ``segment.tools_segment()``.
    With ``ttl`` ("5m" or "1h") the last segment of each stable class carries
    ``cache_control`` (where the Anthropic rendering puts its breakpoints): the sidecar keeps
    the prefix up to there cached for at least that long, in the request's namespace. A
    document (``reuse="anywhere"``) carries ``reuse``.
    """
    tools = tools_segment(prompt.tools)
    segs = ([tools] if tools else []) + list(prompt.rendered())
    out: list[dict[str, Any]] = [
        {"role": s.role, "content": s.content, "tag": s.tag, "stability": s.stability} for s in segs
    ]
    for body, s in zip(out, segs, strict=True):
        if s.reuse is not None:
            body["reuse"] = s.reuse
    if ttl is not None:
        for body, ends in zip(out, class_ends([s.stability for s in segs]), strict=True):
            if ends:
                body["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return out
