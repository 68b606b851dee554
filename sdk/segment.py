"""The parts a prompt is made of: tagged segments and tool schemas (a leaf of the SDK).

``PromptParts`` is the read-only view of a prompt that lint, fingerprint and the renderers
take; ``Prompt`` (prompt.py) provides it, and imports those modules, never the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from .canonical import canonical_json, to_text
from .stability import STABILITIES, Stability, is_stable

__all__ = ["TOOLS_TAG", "PromptParts", "Role", "Segment", "Tool", "tools_segment"]

Role = Literal["system", "user", "assistant"]
Reuse = Literal["anywhere"]  # KV reusable at any offset (a retrieved document; approximate)

TOOLS_TAG = "tools"  # the pseudo-segment that carries tool schemas (see Prompt.tools)


@dataclass(frozen=True, slots=True)
class Segment:
    """One tagged piece of a prompt. ``content`` may be text or JSON-like data."""

    role: Role
    content: str
    tag: str
    stability: Stability = "dynamic"
    # "anywhere": the server may compute this segment's KV once and reuse it at any position,
    # in any order with other such segments (Prompt.builder().document(); docs/prompt-layout.md)
    reuse: Reuse | None = None

    def __init__(
        self,
        role: Role,
        content: Any,
        tag: str,
        stability: Stability = "dynamic",
        reuse: Reuse | None = None,
    ) -> None:
        if reuse not in (None, *get_args(Reuse)):
            raise ValueError(f"reuse must be one of {get_args(Reuse)} or None, got {reuse!r}")
        if reuse is not None and stability != "shared":
            raise ValueError("a segment reused anywhere is a shared segment (a document)")
        if role not in get_args(Role):
            raise ValueError(f"role must be one of {get_args(Role)}, got {role!r}")
        if stability not in STABILITIES:
            raise ValueError(f"stability must be one of {STABILITIES}, got {stability!r}")
        if not isinstance(tag, str) or not tag:
            raise ValueError("segment tag must be a non-empty string")
        text = to_text(content)
        if not text:
            raise ValueError(f"segment {tag!r} has empty content")
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "content", text)
        object.__setattr__(self, "tag", tag)
        object.__setattr__(self, "stability", stability)
        object.__setattr__(self, "reuse", reuse)

    @property
    def is_stable(self) -> bool:
        return is_stable(self.stability)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function tool schema. ``parameters`` is a JSON Schema object, stored canonically."""

    name: str
    description: str
    parameters_json: str

    def __init__(self, name: str, description: str, parameters: Mapping[str, Any]) -> None:
        if not name:
            raise ValueError("tool name must be non-empty")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "description", description)
        object.__setattr__(self, "parameters_json", canonical_json(parameters))

    @property
    def parameters(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.parameters_json)
        return value

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def tools_segment(tools: Sequence[Tool]) -> Segment | None:
    """Tool schemas as one static system segment tagged "tools", or None without tools.

    The sidecar has no ``tools`` field, so the schemas travel as canonical JSON text in front
    of every other segment (where chat templates put them too); the fingerprint covers the
    same segment.
    """
    if not tools:
        return None
    content = canonical_json([t.to_dict() for t in tools])
    return Segment("system", content, TOOLS_TAG, "static")


class PromptParts(Protocol):
    """What lint, fingerprint and the renderers read of a prompt."""

    @property
    def segments(self) -> tuple[Segment, ...]: ...
    @property
    def tools(self) -> tuple[Tool, ...]: ...
    @property
    def shared_order(self) -> str: ...
    def rendered(self) -> tuple[Segment, ...]:
        """Segments in render order: static → shared → session → dynamic."""
        ...
