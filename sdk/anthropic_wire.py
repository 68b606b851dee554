"""Anthropic Messages API responses (whole and streamed) as the SDK's Completion and Delta.

Anthropic counts prompt tokens in three parts: ``input_tokens`` (after the last cache
breakpoint: neither read from nor written to the cache), ``cache_creation_input_tokens``
(written to the cache) and ``cache_read_input_tokens`` (read from it). In the SDK's shape the
prompt is all three, ``cached_tokens`` the reads and ``cache_write_tokens`` the writes.

A prefixcache sidecar's ``/v1/messages`` adds its cache report as ``prefixcache`` (on the
message, and on the stream's ``message_delta``): it becomes the result's ``cache``.
"""

from __future__ import annotations

import msgspec

from .types import CacheReport, Completion, Delta, PromptTokensDetails, Usage

ANTHROPIC_VERSION = "2023-06-01"
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "content_filter",
}


class AnthropicUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class _Block(msgspec.Struct):
    type: str = ""
    text: str | None = None


class AnthropicMessage(msgspec.Struct):
    id: str = ""
    model: str = ""
    role: str = "assistant"
    content: list[_Block] = msgspec.field(default_factory=list)
    stop_reason: str | None = None
    usage: AnthropicUsage | None = None
    prefixcache: CacheReport | None = None  # a prefixcache sidecar's report


class _EventDelta(msgspec.Struct):
    type: str | None = None
    text: str | None = None
    stop_reason: str | None = None


class AnthropicEvent(msgspec.Struct):
    """One streamed event: message_start, content_block_delta, message_delta, ping, ..."""

    type: str = ""
    message: AnthropicMessage | None = None
    delta: _EventDelta | None = None
    usage: AnthropicUsage | None = None
    prefixcache: CacheReport | None = None  # message_delta from a prefixcache sidecar


def to_usage(raw: AnthropicUsage) -> Usage:
    plain = raw.input_tokens or 0
    written = raw.cache_creation_input_tokens or 0
    read = raw.cache_read_input_tokens or 0
    prompt = plain + written + read
    output = raw.output_tokens or 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=output,
        total_tokens=prompt + output,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=read),
        cache_write_tokens=written,
    )


def finish_reason(stop_reason: str | None) -> str | None:
    """OpenAI's names for Anthropic's stop reasons (unknown ones pass through)."""
    return None if stop_reason is None else _FINISH_REASONS.get(stop_reason, stop_reason)


def to_completion(message: AnthropicMessage) -> Completion:
    return Completion(
        text="".join(b.text or "" for b in message.content if b.type == "text"),
        finish_reason=finish_reason(message.stop_reason),
        usage=to_usage(message.usage or AnthropicUsage()),
        cache=message.prefixcache,
        id=message.id,
        model=message.model,
    )


class AnthropicStream:
    """Turns the events of one stream into deltas. ``message_start`` carries the prompt's
    counts, ``message_delta`` the stop reason and the output count so far; the delta made from
    ``message_delta`` carries the finish reason and the whole usage."""

    def __init__(self) -> None:
        self.id = ""
        self.model = ""
        self._usage = AnthropicUsage()

    def feed(self, event: AnthropicEvent) -> Delta | None:
        if event.type == "message_start" and event.message is not None:
            self.id, self.model = event.message.id, event.message.model
            if event.message.usage is not None:
                self._merge(event.message.usage)
            return None
        if event.type == "content_block_delta" and event.delta is not None:
            if event.delta.type == "text_delta" and event.delta.text:
                return Delta(text=event.delta.text)
            return None
        if event.type == "message_delta":
            if event.usage is not None:
                self._merge(event.usage)
            stop = event.delta.stop_reason if event.delta is not None else None
            return Delta(
                finish_reason=finish_reason(stop),
                usage=to_usage(self._usage),
                cache=event.prefixcache,
            )
        return None  # ping, content_block_start/stop, message_stop

    def _merge(self, update: AnthropicUsage) -> None:
        for name in AnthropicUsage.__struct_fields__:
            value = getattr(update, name)
            if value is not None:
                setattr(self._usage, name, value)
