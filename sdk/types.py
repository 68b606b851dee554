"""Typed responses. Every field has a default, so a foreign OpenAI-compatible server that omits
one (or adds others) still parses; prefixcache-only fields are simply ``None`` there."""

from __future__ import annotations

from typing import Any

import msgspec

# Re-exported: ``from prefixcache.sdk.types import CacheStats`` keeps working.
from .cache_stats import BlockStats as BlockStats
from .cache_stats import CacheStats as CacheStats
from .cache_stats import LocalPageStats as LocalPageStats
from .cache_stats import TierBlockStats as TierBlockStats
from .cache_stats import TokenizerPieceStats as TokenizerPieceStats
from .cache_stats import TokenStats as TokenStats
from .canonical import canonical_json


class SegmentReport(msgspec.Struct):
    tag: str = ""
    tokens: int = 0
    cached_tokens: int = 0
    # why the server did not reuse this segment (text, or an object with a "reason"), when it
    # says; None from servers that do not report it
    miss: str | dict[str, Any] | None = None
    # how the server served it: "cached" (exact prefix hit), "reused_anywhere" (a document's
    # stored KV placed here, recomputed_tokens of it computed in place), "computed"; None from
    # servers that do not say
    served: str | None = None
    reused_tokens: int = 0
    recomputed_tokens: int = 0

    @property
    def miss_reason(self) -> str | None:
        if isinstance(self.miss, dict):
            reason = self.miss.get("reason")
            return str(reason) if reason is not None else canonical_json(self.miss)
        return self.miss


class CacheReport(msgspec.Struct):
    """The sidecar's ``prefixcache`` object: cache outcome of the prompt, per segment."""

    cached_tokens: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    segments: list[SegmentReport] = msgspec.field(default_factory=list)
    reused_tokens: int = 0  # prompt tokens placed from the server's document store

    def segment(self, tag: str) -> SegmentReport:
        for report in self.segments:
            if report.tag == tag:
                return report
        raise KeyError(tag)


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    """Token counts in one shape whatever the backend (see ``usage.py``): ``cached_tokens`` +
    ``uncached_tokens`` = ``prompt_tokens``; ``cache_write_tokens`` are the uncached tokens
    the backend wrote to its cache (0 where it does not say)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None
    cache_write_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        details = self.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    @property
    def uncached_tokens(self) -> int:
        return max(0, (self.prompt_tokens or 0) - self.cached_tokens)


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


class UpstreamReset(msgspec.Struct):
    """One upstream's answer to a router's reset: ``status`` None where it was not reached."""

    url: str = ""
    status: int | None = None
    success: bool = False


class ResetPrefixCacheResult(msgspec.Struct):
    """``POST /reset_prefix_cache``'s answer. ``success`` is vLLM's (false: running requests
    held blocks, or an upstream did not reset; retry once idle). A ``prefixcache serve``
    sidecar also says what it evicted and kept; a ``prefixcache route`` one each upstream's
    answer in ``upstreams``; a vLLM server only ``success``. None: not sent by this server."""

    success: bool
    evicted_blocks: int | None = None
    pinned_blocks: int | None = None  # kept, as evict keeps them
    in_use_blocks: int | None = None  # held by running requests at the reset
    upstreams: list[UpstreamReset] | None = None


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


def usage_with_report(usage: Usage | None, report: CacheReport | None) -> Usage | None:
    """An OpenAI-shaped ``usage`` (prefixcache, OpenAI, vLLM, SGLang) in the SDK's shape.

    With a prefixcache report, missing counts come from it and ``cache_write_tokens`` is the
    prompt tokens the engine computed (it caches every block it computes). Servers without a
    report do not say what they wrote: 0.
    """
    if report is None:
        return usage
    usage = usage or Usage()
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    return msgspec.structs.replace(
        usage,
        prompt_tokens=usage.prompt_tokens
        if usage.prompt_tokens is not None
        else report.prompt_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached if cached is not None else report.cached_tokens
        ),
        cache_write_tokens=report.computed_tokens,
    )


def to_completion(raw: ChatCompletion) -> Completion:
    choice = raw.choices[0] if raw.choices else _Choice()
    message = choice.message or choice.delta or _Message()
    return Completion(
        text=message.content or "",
        finish_reason=choice.finish_reason,
        usage=usage_with_report(raw.usage, raw.prefixcache) or Usage(),
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
