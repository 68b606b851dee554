"""The parts a prompt is sent in: messages (text parts, earlier tool calls), segments, their
``cache_control`` retention hints; shared by every request body (protocol.py,
cache_requests.py), with the request ``Error`` and ``fill_defaults`` (null = the default)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from prefixcache.sdk.stability import RANK, Stability

# "developer": OpenAI's newer name for the system role; templates see it as "system".
Role = Literal["system", "developer", "user", "assistant"]
MessageRole = Literal["system", "developer", "user", "assistant", "tool"]
FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
CacheSalt = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+\Z")
]
Tag = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Segments are rendered one prefix at a time (chat/rendering.py): their count bounds that work.
MAX_SEGMENTS = 256


class Error(ValueError):
    """A request that decoded but makes no sense as a whole; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def fill_defaults(obj: msgspec.Struct, defaults: dict[str, Any]) -> None:
    """An explicit ``null`` means the default (OpenAI allows null for optional fields)."""
    for name, value in defaults.items():
        if getattr(obj, name) is None:
            setattr(obj, name, value)


# Anthropic's retention hint: "keep the prompt up to here cached at least this long".
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_CACHE_BREAKPOINTS = 4  # as Anthropic's


class CacheControl(msgspec.Struct):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def ttl_s(self) -> float:
        return CACHE_TTLS[self.ttl]


# OpenAI's explicit breakpoint on a content part: the same hint, its lifetimes. Without a
# ttl it takes the request's prompt_cache_options.ttl, whose only value is 30m.
BREAKPOINT_TTLS = {"30m": 1800.0, "12h": 12 * 3600.0}
MAX_OPENAI_BREAKPOINTS = 4  # written per request, the latest ones (older ones are not refused)


class PromptCacheBreakpoint(msgspec.Struct):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] = "30m"


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # Anthropic's
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # OpenAI's

    @property
    def retention_s(self) -> float | None:
        """How long this part's end asks to stay cached (either mark; the longer of both)."""
        ttls = []
        if self.cache_control is not None:
            ttls.append(self.cache_control.ttl_s)
        if self.prompt_cache_breakpoint is not None:
            ttls.append(BREAKPOINT_TTLS[self.prompt_cache_breakpoint.ttl])
        return max(ttls, default=None)


class FunctionCall(msgspec.Struct):
    name: FunctionName
    arguments: str  # JSON text of an object (OpenAI's form)


class ToolCallItem(msgspec.Struct):
    """An earlier assistant turn's tool call, sent back in the history."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct):
    role: MessageRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: which call this is the result of

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins text parts


class Segment(msgspec.Struct):
    role: Role
    content: str
    tag: Tag
    stability: Stability = "dynamic"
    cache_control: CacheControl | None = None  # keep the prompt up to this segment's end
    # "anywhere": this segment's KV may be computed once and reused at any offset, in any
    # combination with other such segments (approximate; docs/prompt-layout.md)
    reuse: Literal["anywhere"] | None = None


def order_segments(segments: list[Segment]) -> list[Segment]:
    """static → shared → session → dynamic, stable within a class."""
    return sorted(segments, key=lambda s: RANK[s.stability])
