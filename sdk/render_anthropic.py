"""Anthropic Messages body with ``cache_control`` breakpoints at stability boundaries.

Anthropic caches the prefix tools → system → messages up to a block marked
``"cache_control": {"type": "ephemeral"}``, with at most 4 such breakpoints per request. Tools
count as static. A breakpoint goes on the last block of each stable class (static, shared,
session), so at most 3 are used, and never on a dynamic block.

System segments that render before every user/assistant segment go into ``system``; a system
segment that renders later (a dynamic instruction, say) becomes a user text block in place,
because moving it up into ``system`` would change the order the model sees. Consecutive
segments of one role are merged into one message with several text blocks.
"""

from __future__ import annotations

from typing import Any

from .segment import PromptParts
from .stability import class_ends

MAX_BREAKPOINTS = 4


def render_anthropic(
    prompt: PromptParts,
    *,
    model: str | None = None,
    max_tokens: int | None = None,
    ttl: str | None = None,
    **params: Any,
) -> dict[str, Any]:
    """A ``POST /v1/messages`` body; ``ttl`` ("5m" or "1h") goes into every breakpoint."""
    marker: dict[str, str] = {"type": "ephemeral"}
    if ttl is not None:
        marker["ttl"] = ttl

    # (block, stability) in cache order: tools, then system, then message blocks.
    tools: list[tuple[dict[str, Any], str]] = [
        (
            {"name": t.name, "description": t.description, "input_schema": t.parameters},
            "static",
        )
        for t in prompt.tools
    ]
    system: list[tuple[dict[str, Any], str]] = []
    turns: list[tuple[str, list[tuple[dict[str, Any], str]]]] = []
    for seg in prompt.rendered():
        block: dict[str, Any] = {"type": "text", "text": seg.content}
        if seg.role == "system" and not turns:
            system.append((block, seg.stability))
            continue
        role = "assistant" if seg.role == "assistant" else "user"
        if turns and turns[-1][0] == role:
            turns[-1][1].append((block, seg.stability))
        else:
            turns.append((role, [(block, seg.stability)]))
    if not turns:
        raise ValueError("an Anthropic request needs at least one user or assistant segment")

    ordered = tools + system + [item for _, blocks in turns for item in blocks]
    marked = 0
    for (block, _), ends in zip(ordered, class_ends([s for _, s in ordered]), strict=True):
        if ends:
            block["cache_control"] = dict(marker)
            marked += 1
    assert marked <= MAX_BREAKPOINTS

    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if system:
        body["system"] = [block for block, _ in system]
    if tools:
        body["tools"] = [block for block, _ in tools]
    body["messages"] = [
        {"role": role, "content": [block for block, _ in blocks]} for role, blocks in turns
    ]
    body.update(params)
    return body
