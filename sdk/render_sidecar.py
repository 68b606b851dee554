"""The prefixcache sidecar's segment request (see the wire contract in docs/sdk.md)."""

from __future__ import annotations

from .segment import PromptParts, tools_segment


def render_segments(prompt: PromptParts) -> list[dict[str, str]]:
    """The ``segments`` list, already in render order (the sidecar orders them the same way).

    The sidecar has no ``tools`` field: tool schemas go first, as ``segment.tools_segment()``.
    """
    tools = tools_segment(prompt.tools)
    segs = ([tools] if tools else []) + list(prompt.rendered())
    return [
        {"role": s.role, "content": s.content, "tag": s.tag, "stability": s.stability} for s in segs
    ]
