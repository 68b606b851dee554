"""Typed responses. Every field has a default, so a foreign OpenAI-compatible server that omits
one (or adds others) still parses; prefixcache-only fields are simply ``None`` there."""

from __future__ import annotations

import msgspec

# Re-exported: ``from prefixcache.sdk.types import CacheStats`` keeps working.
from .cache_stats import (  # noqa: F401
    BlockStats,
    CacheStats,
    TokenizerPieceStats,
    TokenStats,
)


class SegmentReport(msgspec.Struct):
    tag: str = ""
    tokens: int = 0
    cached_tokens: int = 0


class CacheReport(msgspec.Struct):
    """The sidecar's ``prefixcache`` object: cache outcome of the prompt, per segment."""

    cached_tokens: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    segments: list[SegmentReport] = msgspec.field(default_factory=list)

    def segment(self, tag: str) -> SegmentReport:
        for report in self.segments:
            if report.tag == tag:
                return report
        raise KeyError(tag)


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None

    @property
    def cached_tokens(self) -> int:
        details = self.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0


class Completion(msgspec.Struct):
    """The result of ``complete()``: text, why it stopped, usage, and the cache report."""

    text: str
    finish_reason: str | None
    usage: Usage
    cache: CacheReport | None  # None from servers other than a prefixcache sidecar
    id: str = ""
    model: str = ""


class Delta(msgspec.Struct):
    """One step of ``stream()``. The step that finishes carries ``finish_reason`` and
    ``cache``; with usage included, a last step carries only ``usage``."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    cache: CacheReport | None = None


class WarmResult(msgspec.Struct):
    tokens: int = 0
    cached_tokens: int = 0
    pinned_blocks: int = 0


class SaveResult(msgspec.Struct):
    name: str = ""
    prefixes: int = 0
    blocks: int = 0
    bytes: int = 0


class LoadResult(msgspec.Struct):
    name: str = ""
    prefixes: int = 0
    blocks: int = 0
    restored_blocks: int = 0
    reused_blocks: int = 0
    skipped_blocks: int = 0
    pinned_prefixes: int = 0


# --- raw wire shapes (OpenAI chat.completion and chat.completion.chunk) ----------------------


class _Message(msgspec.Struct):
    role: str | None = None
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    message: _Message | None = None
    delta: _Message | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct):
    """``chat.completion`` and ``chat.completion.chunk`` (choices carry message or delta)."""

    id: str | None = None
    model: str | None = None
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    prefixcache: CacheReport | None = None


def to_completion(raw: ChatCompletion) -> Completion:
    choice = raw.choices[0] if raw.choices else _Choice()
    message = choice.message or choice.delta or _Message()
    return Completion(
        text=message.content or "",
        finish_reason=choice.finish_reason,
        usage=raw.usage or Usage(),
        cache=raw.prefixcache,
        id=raw.id or "",
        model=raw.model or "",
    )


def to_delta(raw: ChatCompletion) -> Delta:
    choice = raw.choices[0] if raw.choices else _Choice()
    delta = choice.delta or choice.message or _Message()
    return Delta(
        text=delta.content or "",
        finish_reason=choice.finish_reason,
        usage=raw.usage,
        cache=raw.prefixcache,
    )
