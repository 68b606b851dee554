"""The prefixcache sidecar's segment request (see the wire contract in docs/sdk.md)."""

from __future__ import annotations

from .prompt import Prompt


def render_segments(prompt: Prompt) -> list[dict[str, str]]:
    """The ``segments`` list, already in render order (the sidecar orders them the same way).

    The sidecar has no ``tools`` field: tool schemas go first, as ``prompt.tools_segment()``.
    """
    tools = prompt.tools_segment()
    segs = ([tools] if tools else []) + list(prompt.rendered())
    return [
        {"role": s.role, "content": s.content, "tag": s.tag, "stability": s.stability} for s in segs
    ]
