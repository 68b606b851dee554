"""Prompts made of tagged segments, rendered stable-first.

A segment has a role, text content (structured data is serialized canonically), a unique tag
and a stability class. Rendering orders segments static → shared → session → dynamic, keeping
the declared order within a class, so the longest possible prefix stays the same from one
request to the next.

``Prompt`` sits above lint, fingerprint and the renderers: they read a prompt through
``segment.PromptParts`` and never import this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from .canonical import to_text
from .fingerprint import Fingerprint, compute_fingerprint
from .lint import Finding, ReportLike, lint
from .render_anthropic import render_anthropic
from .render_openai import render_openai
from .render_sidecar import render_segments
from .segment import TOOLS_TAG, Role, Segment, Tool, tools_segment
from .stability import RANK, STABILITIES, Stability

__all__ = ["RANK", "STABILITIES", "TOOLS_TAG", "Prompt", "PromptBuilder", "Segment", "Tool"]

SharedOrder = Literal["declared", "tag"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """An immutable prompt: segments in declared order, optional tools, shared-segment order.

    ``tools`` count as static material placed before every segment. ``shared_order="tag"``
    sorts shared segments by tag so that the same documents always render in the same order,
    whatever order retrieval returned them in.
    """

    segments: tuple[Segment, ...]
    tools: tuple[Tool, ...] = ()
    shared_order: SharedOrder = "declared"
    _rendered: tuple[Segment, ...] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        segments: Iterable[Segment] = (),
        tools: Iterable[Tool] = (),
        shared_order: SharedOrder = "declared",
    ) -> None:
        segs = tuple(segments)
        tool_list = tuple(tools)
        if shared_order not in get_args(SharedOrder):
            raise ValueError(f"shared_order must be 'declared' or 'tag', got {shared_order!r}")
        tags = [s.tag for s in segs]
        if len(set(tags)) != len(tags):
            dupes = sorted({t for t in tags if tags.count(t) > 1})
            raise ValueError(f"segment tags must be unique; repeated: {dupes}")
        if tool_list and TOOLS_TAG in tags:
            raise ValueError(f"tag {TOOLS_TAG!r} is reserved for the tool schemas")
        names = [t.name for t in tool_list]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        object.__setattr__(self, "segments", segs)
        object.__setattr__(self, "tools", tool_list)
        object.__setattr__(self, "shared_order", shared_order)
        object.__setattr__(self, "_rendered", _order(segs, shared_order))

    @staticmethod
    def builder() -> PromptBuilder:
        return PromptBuilder()

    @classmethod
    def from_messages(
        cls, messages: Iterable[Mapping[str, Any]], stability: Stability = "dynamic"
    ) -> Prompt:
        """Wrap plain chat messages; tags are ``m0``, ``m1``, ... in order."""
        segs = [
            Segment(m["role"], m["content"], f"m{i}", stability) for i, m in enumerate(messages)
        ]
        return cls(segs)

    # --- derived values -----------------------------------------------------------------

    def rendered(self) -> tuple[Segment, ...]:
        """Segments in render order: static → shared → session → dynamic."""
        return self._rendered

    def segment(self, tag: str) -> Segment:
        for s in self.segments:
            if s.tag == tag:
                return s
        raise KeyError(tag)

    def tools_segment(self) -> Segment | None:
        """Tool schemas as one static system segment tagged "tools" (see segment.py)."""
        return tools_segment(self.tools)

    def fingerprint(self) -> Fingerprint:
        """Chained digests of the tools and the stable segments, in render order."""
        return compute_fingerprint(self)

    def lint(
        self, previous: Prompt | None = None, report: ReportLike | None = None
    ) -> list[Finding]:
        """Cache-breakers in this prompt; ``previous`` adds checks across two renders;
        ``report`` (a response's ``out.cache``) adds why a stable segment missed."""
        return lint(self, previous, report)

    # --- new prompts from this one ------------------------------------------------------

    def append(self, *segments: Segment) -> Prompt:
        return Prompt((*self.segments, *segments), self.tools, self.shared_order)

    def without(self, *tags: str) -> Prompt:
        drop = set(tags)
        missing = drop - {s.tag for s in self.segments}
        if missing:
            raise KeyError(f"no segment tagged {sorted(missing)}")
        kept = [s for s in self.segments if s.tag not in drop]
        return Prompt(kept, self.tools, self.shared_order)

    def without_dynamic(self) -> Prompt:
        return Prompt([s for s in self.segments if s.is_stable], self.tools, self.shared_order)

    def with_shared_order(self, order: SharedOrder) -> Prompt:
        return Prompt(self.segments, self.tools, order)

    def replace_content(self, tag: str, content: Any) -> Prompt:
        self.segment(tag)  # KeyError if absent
        segs = [replace(s, content=to_text(content)) if s.tag == tag else s for s in self.segments]
        return Prompt(segs, self.tools, self.shared_order)

    # --- renderers ----------------------------------------------------------------------

    def to_segments(self, ttl: str | None = None) -> list[dict[str, Any]]:
        """The ``segments`` field of a prefixcache sidecar request (tools become a segment);
        ``ttl`` ("5m", "1h") marks where each stable class ends with ``cache_control``."""
        return render_segments(self, ttl)

    def to_messages(self) -> list[dict[str, Any]]:
        """Plain OpenAI chat messages in render order (tools are not included)."""
        return [{"role": s.role, "content": s.content} for s in self._rendered]

    def to_openai(self, **params: Any) -> dict[str, Any]:
        return render_openai(self, **params)

    def to_anthropic(self, **params: Any) -> dict[str, Any]:
        return render_anthropic(self, **params)


def _order(segs: tuple[Segment, ...], shared_order: SharedOrder) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for stability in STABILITIES:
        group = [s for s in segs if s.stability == stability]
        if stability == "shared" and shared_order == "tag":
            group.sort(key=lambda s: s.tag)
        out.extend(group)
    return tuple(out)


class PromptBuilder:
    """Fluent construction: ``Prompt.builder().static(...).shared(...).dynamic(...).build()``."""

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self._tools: list[Tool] = []
        self._shared_order: SharedOrder = "declared"

    def add(self, segment: Segment) -> PromptBuilder:
        self._segments.append(segment)
        return self

    def static(self, content: Any, *, tag: str, role: Role = "system") -> PromptBuilder:
        return self.add(Segment(role, content, tag, "static"))

    def shared(self, content: Any, *, tag: str, role: Role = "user") -> PromptBuilder:
        return self.add(Segment(role, content, tag, "shared"))

    def document(self, content: Any, *, tag: str, role: Role = "user") -> PromptBuilder:
        """A retrieved document: a shared segment whose KV the sidecar may reuse at any
        position and in any order with other documents (``reuse="anywhere"``). Its outputs are
        approximate; docs/prompt-layout.md says when that pays."""
        return self.add(Segment(role, content, tag, "shared", reuse="anywhere"))

    def session(self, content: Any, *, tag: str, role: Role = "user") -> PromptBuilder:
        return self.add(Segment(role, content, tag, "session"))

    def dynamic(self, content: Any, *, tag: str, role: Role = "user") -> PromptBuilder:
        return self.add(Segment(role, content, tag, "dynamic"))

    def tool(self, name: str, description: str, parameters: Mapping[str, Any]) -> PromptBuilder:
        self._tools.append(Tool(name, description, parameters))
        return self

    def order_shared_by_tag(self) -> PromptBuilder:
        self._shared_order = "tag"
        return self

    def build(self) -> Prompt:
        return Prompt(self._segments, self._tools, self._shared_order)
