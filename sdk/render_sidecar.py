"""The prefixcache sidecar's segment request (see the wire contract in docs/sdk.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .canonical import canonical_json

if TYPE_CHECKING:
    from .prompt import Prompt, Segment


def tools_segment(prompt: Prompt) -> Segment | None:
    """Tool schemas as one static system segment tagged "tools", or None without tools.

    The sidecar has no ``tools`` field, so the schemas travel as canonical JSON text in front
    of every other segment (where chat templates put them too).
    """
    from .prompt import TOOLS_TAG, Segment

    if not prompt.tools:
        return None
    return Segment(
        "system", canonical_json([t.to_dict() for t in prompt.tools]), TOOLS_TAG, "static"
    )


def render_segments(prompt: Prompt) -> list[dict[str, str]]:
    """The ``segments`` list, already in render order (the sidecar orders them the same way)."""
    tools = tools_segment(prompt)
    segs = ([tools] if tools else []) + list(prompt.rendered())
    return [
        {"role": s.role, "content": s.content, "tag": s.tag, "stability": s.stability} for s in segs
    ]
