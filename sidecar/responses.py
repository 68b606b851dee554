"""Engine outputs → OpenAI response objects (whole responses, stream chunks, logprobs)."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.engine.request import RequestTiming, SegmentSpan, TokenLogprob, Usage

from .protocol import CacheReport, PromptTokensDetails, SegmentReport, UsageInfo

Decode = Callable[[list[int]], str]
TokenBytes = Callable[[int], bytes]


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def server_timing(timing: RequestTiming) -> str:
    """A W3C Server-Timing header value: where the engine spent a request's time, in ms."""
    parts = [
        ("queue", timing.queue_seconds),
        ("prefill", timing.prefill_seconds),
        ("decode", timing.decode_seconds),
        ("engine", timing.engine_seconds),
    ]
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in parts)


def cache_report(usage: Usage, spans: list[SegmentSpan]) -> CacheReport:
    """The ``prefixcache`` object. Segment hits come from the engine, or else from the spans."""
    if usage.segments is not None:
        segments = [SegmentReport(s.tag, s.tokens, s.cached_tokens) for s in usage.segments]
    else:
        segments = [
            SegmentReport(s.tag, s.end - s.start, _overlap(s, usage.cached_tokens)) for s in spans
        ]
    return CacheReport(
        cached_tokens=usage.cached_tokens,
        prompt_tokens=usage.prompt_tokens,
        computed_tokens=usage.computed_prompt_tokens,
        segments=segments,
    )


def _overlap(span: SegmentSpan, cached_tokens: int) -> int:
    return max(0, min(span.end, cached_tokens) - span.start)


def chat_logprobs(entries: list[TokenLogprob], decode: Decode, token_bytes: TokenBytes) -> dict:
    """``token`` is the decoded text (U+FFFD for part of a character, as OpenAI); ``bytes``
    are the token's raw bytes, so joining them rebuilds the exact UTF-8 output."""

    def item(token_id: int, logprob: float) -> dict:
        return {
            "token": decode([token_id]),
            "logprob": logprob,
            "bytes": list(token_bytes(token_id)),
        }

    content = []
    for entry in entries:
        top = [item(t, lp) for t, lp in entry.top]
        content.append({**item(entry.token_id, entry.logprob), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries: list[TokenLogprob], decode: Decode, offset: int = 0) -> dict:
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        token = decode([entry.token_id])
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        top_logprobs.append({decode([t]): lp for t, lp in entry.top})
        text_offset.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
