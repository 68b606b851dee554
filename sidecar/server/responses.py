"""Replies from an engine stream: a whole JSON response or SSE chunks, with usage, the
cache report and logprobs. Independent of the app: a ``Job`` and the tokenizer are all it needs.

Errors after the first SSE frame go in-band (an OpenAI error object), then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from prefixcache.engine.api import TokenizerAPI
from prefixcache.engine.request import (
    RequestTiming,
    RetentionHint,
    SegmentMiss,
    SegmentSpan,
    TokenLogprob,
    Usage,
)

from ..chat.generic_tools import GenericParser
from ..chat.tool_calls import (
    CallDelta,
    ForcedParser,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    forced_call_cut,
)
from ..http.errors import APIError, server_error
from ..http.streaming import DONE, SSEResponse, interleave, run_until_disconnect, sse_event
from ..wire import reply_types as rt
from .admission import EngineStream
from .logprob_format import (
    TokenOffsets,
    chat_logprobs,
    completion_logprobs,
    joined,
    vllm_prompt_logprobs,
)

log = logging.getLogger("prefixcache.sidecar")


def cache_write_tokens(usage: Usage) -> int:
    """The prompt's tokens written to the cache, its uncached part at most: with the cached
    ones they add up to the prompt (counted once), not to every choice's or a preempted
    request's recomputed tokens, which the ``prefixcache`` report's ``computed_tokens`` sums."""
    return max(0, min(usage.computed_prompt_tokens, usage.prompt_tokens - usage.cached_tokens))


def usage_info(usage: Usage) -> rt.UsageInfo:
    return rt.UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=rt.PromptTokensDetails(
            cached_tokens=usage.cached_tokens, cache_write_tokens=cache_write_tokens(usage)
        ),
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


def cache_report(usage: Usage, spans: list[SegmentSpan]) -> rt.CacheReport:
    """The ``prefixcache`` object. Segment hits come from the engine, or else from the spans."""
    if usage.segments is not None:
        segments = [
            rt.SegmentReport(
                s.tag,
                s.tokens,
                s.cached_tokens,
                miss_report(s.miss),
                s.served or _served(s.tokens, s.cached_tokens),
                s.reused_tokens,
                s.recomputed_tokens,
            )
            for s in usage.segments
        ]
    else:
        segments = []
        for s in spans:
            hit = _overlap(s, usage.cached_tokens)
            served = _served(s.end - s.start, hit)
            segments.append(rt.SegmentReport(s.tag, s.end - s.start, hit, served=served))
    return rt.CacheReport(
        cached_tokens=usage.cached_tokens,
        prompt_tokens=usage.prompt_tokens,
        computed_tokens=usage.computed_prompt_tokens,
        segments=segments,
        cached_tokens_by_tier=usage.cached_tokens_by_tier or msgspec.UNSET,
        reused_tokens=usage.reused_tokens or msgspec.UNSET,
    )


def _served(tokens: int, cached_tokens: int) -> str:
    return "cached" if cached_tokens == tokens else "computed"


def miss_report(miss: SegmentMiss | None) -> rt.SegmentMiss | None:
    if miss is None:
        return None
    return rt.SegmentMiss(miss.reason, miss.segment, miss.evicted_at, miss.evicted_by)


def _overlap(span: SegmentSpan, cached_tokens: int) -> int:
    return max(0, min(span.end, cached_tokens) - span.start)


# --- whole replies and streams -------------------------------------------------------------


@dataclass(slots=True)
class Job:
    """One admitted generation request and what its replies need."""

    id: str
    kind: str  # "chat" | "completion"
    model: str
    created: int
    spans: list[SegmentSpan]
    stream: EngineStream
    want_logprobs: bool
    include_usage: bool
    fingerprint: str  # system_fingerprint
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    prompt_tokens: int | None = None  # the prompt's length (None: the engine request's)
    tool_parser: ToolCallParser | None = None  # chat with tools: output → tool_calls
    retain: list[RetentionHint] = field(default_factory=list)  # the prompt's cache_control marks
    index: int = 0  # which of the request's choices (prompt i's choice j: i * choices + j)
    choices: int = 1  # n: choices per prompt
    echo: str | None = None  # completions' echo: the prompt text put before the completion
    message_echo: str = ""  # chat's echo (vLLM's): the last message's text before the content
    prompt_only: bool = False  # echo with max_tokens 0: its one generated token is not shown
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs=k: shown as vLLM shows them
    return_token_ids: bool = False  # vLLM's: the prompt's and the choice's token ids shown

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.stream.request.prompt_token_ids)


@dataclass(slots=True)
class Collected:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob]
    timing: RequestTiming | None
    token_ids: list[int] = field(default_factory=list)  # the generated tokens
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs
    stop_reason: int | str | None = None  # the engine's: the stop string or token id matched


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


async def reply(
    jobs: list[Job], stream: bool, request: Request, tokenizer: TokenizerAPI
) -> Response | SSEResponse:
    """The reply to a request's choices (one job each): SSE when ``stream``, else the whole
    response once every choice has ended."""
    job = jobs[0]
    if stream:
        return SSEResponse(stream_events(jobs, tokenizer), on_close=lambda: close_jobs(jobs))
    try:
        results = await run_until_disconnect(collect_all(jobs), request.receive)
    finally:
        await close_jobs(jobs)  # aborts the engine requests still running
    if job.prompt_only:
        results = [prompt_alone(r) for r in results]

    def encoded() -> bytes:
        return msgspec.json.encode(reply_body(jobs, results, tokenizer))

    if job.prompt_logprobs is not None or (job.echo is not None and job.want_logprobs):
        data = await asyncio.to_thread(encoded)  # entries per prompt token: off the event loop
    else:
        data = encoded()
    response = Response(data, 200, media_type="application/json")
    if results[0].timing is not None:
        response.headers["server-timing"] = server_timing(results[0].timing)
    return response


def reply_body(jobs: list[Job], results: list[Collected], tokenizer: TokenizerAPI) -> Any:
    """The whole (non-streamed) reply to a request's choices."""
    job = jobs[0]
    usage = merged_usage(jobs, [r.usage for r in results])
    report = cache_report(usage, job.spans)
    head = (job.id, job.created, job.model)
    body: Any
    if job.kind == "chat":
        chat_choices = []
        for j, result in zip(jobs, results, strict=True):
            logprobs = None
            if j.want_logprobs:
                logprobs = _logprobs(
                    j, tokenizer, result.logprobs, TokenOffsets(_decoder(tokenizer))
                )
            message, finish = _chat_message(j, result)
            if j.message_echo:
                message.content = j.message_echo + (message.content or "")
            choice = rt.ChatChoice(j.index, message, finish, logprobs, result.stop_reason)
            if j.return_token_ids:
                choice.token_ids = result.token_ids
            chat_choices.append(choice)
        body = rt.ChatCompletion(*head, chat_choices, usage_info(usage), report, job.fingerprint)
        body.prompt_logprobs = _vllm_prompt_logprobs(job, tokenizer, results[0])
        if job.return_token_ids:
            body.prompt_token_ids = job.prompt_token_ids
    else:
        text_choices = []
        for j, result in zip(jobs, results, strict=True):
            logprobs, echo = None, j.echo or ""
            if j.want_logprobs:
                offsets = TokenOffsets(_decoder(tokenizer), len(echo))
                logprobs = _logprobs(j, tokenizer, result.logprobs, offsets)
                if j.echo is not None:
                    logprobs = joined(_echoed(j, tokenizer, result.prompt_logprobs), logprobs)
            choice = rt.CompletionChoice(
                j.index, echo + result.text, result.finish_reason, logprobs, result.stop_reason
            )
            choice.prompt_logprobs = _vllm_prompt_logprobs(j, tokenizer, result)
            if j.return_token_ids:
                choice.token_ids, choice.prompt_token_ids = result.token_ids, j.prompt_token_ids
            text_choices.append(choice)
        body = rt.Completion(*head, text_choices, usage_info(usage), report, job.fingerprint)
    return body


async def close_jobs(jobs: list[Job]) -> None:
    for job in jobs:
        await job.stream.aclose()


def prompt_alone(result: Collected) -> Collected:
    """An echo without generation: the one token the engine made is not shown or counted."""
    usage = dataclasses.replace(result.usage, completion_tokens=0)
    return Collected("", "length", usage, [], result.timing, [], result.prompt_logprobs)


def merged_usage(jobs: list[Job], usages: list[Usage]) -> Usage:
    """The usage of a request's choices: each prompt once, with its first choice's cache
    figures (what serving it cost), the completions summed and the prompt tokens every
    choice computed summed (the prefill work of the whole request)."""
    if len(usages) == 1:
        return usages[0]
    firsts = [u for job, u in zip(jobs, usages, strict=True) if job.index % job.choices == 0]
    tiers: dict[str, int] = {}
    for u in firsts:
        for tier, tokens in (u.cached_tokens_by_tier or {}).items():
            tiers[tier] = tiers.get(tier, 0) + tokens
    return dataclasses.replace(
        firsts[0],
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        cached_tokens=sum(u.cached_tokens for u in firsts),
        reused_tokens=sum(u.reused_tokens for u in firsts),
        cached_tokens_by_tier=tiers or None,
        segments=firsts[0].segments if len(firsts) == 1 else None,
        completion_tokens=sum(u.completion_tokens for u in usages),
        computed_prompt_tokens=sum(u.computed_prompt_tokens for u in usages),
    )


def _chat_message(job: Job, result: Collected) -> tuple[rt.ChatMessage, str]:
    if job.tool_parser is None:
        return rt.ChatMessage("assistant", result.text), result.finish_reason
    parsed = job.tool_parser.parse(result.text)
    if not parsed.tool_calls:  # a forced output cut in its first name: nothing to show
        text = parsed.content if job.tool_parser.rewrites_content else result.text
        return rt.ChatMessage("assistant", text), result.finish_reason
    calls = [_tool_call_reply(call) for call in parsed.tool_calls]
    # calls max_tokens or a stop string cut (a forced one's arguments as far as they came)
    # say what cut them
    cut = result.finish_reason == "length" or forced_call_cut(job.tool_parser, result.text)
    reason = result.finish_reason if cut or _named(job) else "tool_calls"
    return rt.ChatMessage("assistant", parsed.content, tool_calls=calls), reason


def _named(job: Job) -> bool:
    """A call ``tool_choice`` named: it finishes "stop", as OpenAI's and vLLM's do (theirs
    "tool_calls" for auto and required)."""
    parser = job.tool_parser
    return isinstance(parser, (ForcedParser, GenericParser)) and parser.function is not None


def _tool_call_reply(call: ToolCall) -> rt.ToolCallReply:
    return rt.ToolCallReply(call.id, rt.FunctionCallReply(call.name, call.arguments))


def _call_delta_choice(delta: CallDelta, choice: int) -> rt.ChatChunkChoice:
    """A piece of a call as OpenAI streams it: its id and name (arguments ""), or more of its
    arguments."""
    if delta.id is not None:
        piece = rt.ToolCallDelta(delta.index, delta.id, "function", rt.FunctionDelta(delta.name, ""))  # fmt: skip
    else:
        piece = rt.ToolCallDelta(delta.index, function=rt.FunctionDelta(arguments=delta.arguments))
    return rt.ChatChunkChoice(choice, rt.ChatDelta(tool_calls=[piece]))


async def collect(job: Job) -> Collected:
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    token_ids: list[int] = []
    prompt_logprobs = None
    async for out in job.stream:
        raise_engine_error(out.error, out.finish_reason)
        parts.append(out.text_delta)
        token_ids.extend(out.new_token_ids)
        logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
        if out.finished:
            usage = out.usage or fallback_usage(job, len(token_ids))
            reason = out.finish_reason or "stop"
            text = "".join(parts)
            return Collected(
                text, reason, usage, logprobs, out.timing, token_ids, prompt_logprobs,
                out.stop_reason,
            )  # fmt: skip
    raise server_error("the engine ended the request without a final output")


async def collect_all(jobs: list[Job]) -> list[Collected]:
    """Every choice collected; the first failure cancels the others (then closed by the
    caller). One choice runs in the caller's task, as before choices existed."""
    if len(jobs) == 1:
        return [await collect(jobs[0])]
    tasks = [asyncio.ensure_future(collect(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# A choice's frame: its choices list, its usage on its last frame (else None), and the
# tokens it has generated so far (vLLM's continuous_usage_stats shows them on every chunk).
ChoiceFrame = tuple[list[Any], Usage | None, int]


async def stream_events(jobs: list[Job], tokenizer: TokenizerAPI) -> AsyncIterator[bytes]:
    """The SSE frames of a request's choices, interleaved as their tokens come."""
    job = jobs[0]
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    no_usage = None if job.include_usage else msgspec.UNSET  # OpenAI: null until the last

    def frame(choices: list, **extra: Any) -> bytes:
        extra.setdefault("usage", no_usage)
        chunk = rt.StreamChunk(
            job.id, obj, job.created, job.model, job.fingerprint, choices, **extra
        )
        return sse_event(chunk)

    usages: dict[int, Usage] = {}
    started: set[int] = set()  # choices whose first frame is out
    try:
        async for index, (choices, usage, tokens) in interleave(
            [choice_frames(j, tokenizer) for j in jobs]
        ):
            extra: dict[str, Any] = {}
            if job.continuous_usage:
                extra["usage"] = running_usage(jobs[index], usage, tokens)
            if job.return_token_ids and index not in started and choices:
                prompt_ids = jobs[index].prompt_token_ids  # once, as vLLM: chat's on the chunk
                if job.kind == "chat":
                    extra["prompt_token_ids"] = prompt_ids
                else:
                    choices[0].prompt_token_ids = prompt_ids
            if choices:
                started.add(index)
            if usage is None:
                yield frame(choices, **extra)
                continue
            usages[index] = usage
            yield frame(choices, prefixcache=cache_report(usage, job.spans), **extra)
        if job.include_usage:
            usage = merged_usage(jobs, [usages[i] for i in range(len(jobs))])
            yield frame([], usage=usage_info(usage))
    except APIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:
        log.exception("stream %s failed", job.id)
        yield sse_event(server_error(f"generation failed: {type(exc).__name__}").body())
    yield DONE


def running_usage(job: Job, usage: Usage | None, tokens: int) -> rt.UsageInfo:
    """A choice's usage so far, as vLLM's continuous_usage_stats shows it on each chunk: its
    prompt and the tokens it has generated (its final usage's on its last chunk)."""
    if usage is not None:
        prompt, tokens = usage.prompt_tokens, usage.completion_tokens
    else:
        prompt = prompt_count(job)
    return rt.UsageInfo(prompt, tokens, prompt + tokens)


def prompt_count(job: Job) -> int:
    if job.prompt_tokens is not None:
        return job.prompt_tokens
    return len(job.stream.request.prompt_token_ids)


async def choice_frames(job: Job, tokenizer: TokenizerAPI) -> AsyncIterator[ChoiceFrame]:
    """One choice's frames, to its finish (which carries its usage)."""
    num_tokens = 0
    offsets = None  # the completion's token offsets, carried from one output to the next
    calls = None if job.tool_parser is None else ToolCallStream(job.tool_parser)
    first = True
    pending: list[int] = []  # return_token_ids: generated ids no chunk has carried yet

    def with_ids(choices: list[Any]) -> list[Any]:
        """vLLM's return_token_ids: the chunk carries the ids generated since the last one."""
        if job.return_token_ids:
            choices[0].token_ids = pending[:]
            pending.clear()
        return choices

    async for out in job.stream:
        raise_engine_error(out.error, out.finish_reason)
        if first and job.kind == "chat":
            # The role when the first token is out, as vLLM sends it: a client times its
            # first token by the first chunk, so this one must not come before the prompt's
            # computation. A forced call has no content: none, not "" (as OpenAI's).
            content = None if isinstance(job.tool_parser, ForcedParser) else ""
            yield (
                [rt.ChatChunkChoice(job.index, rt.ChatDelta("assistant", content))],
                None,
                num_tokens,
            )
            if job.message_echo:  # then the echo, as vLLM streams it
                yield (
                    [rt.ChatChunkChoice(job.index, rt.ChatDelta(content=job.message_echo))],
                    None,
                    num_tokens,
                )
        first = False
        if job.echo is not None and num_tokens == 0:  # the prompt first, as vLLM streams it
            echoed = None
            if job.want_logprobs:
                echoed = _echoed(job, tokenizer, out.prompt_logprobs)
            yield [_delta_choice(job, job.echo, None, echoed)], None, num_tokens
            if job.prompt_only:  # one token was asked for: this output is the last
                usage = dataclasses.replace(
                    out.usage or fallback_usage(job, 0), completion_tokens=0
                )
                yield [_delta_choice(job, None, "length", None)], usage, num_tokens
                return
        num_tokens += len(out.new_token_ids)
        if job.return_token_ids:
            pending.extend(out.new_token_ids)
        logprobs = None
        if job.want_logprobs and out.logprobs:
            if offsets is None:
                offsets = TokenOffsets(_decoder(tokenizer), len(job.echo or ""))
            logprobs = _logprobs(job, tokenizer, out.logprobs, offsets)
        text = out.text_delta if calls is None else calls.push(out.text_delta)
        if out.finished and calls is None:  # the finish on the last token's own chunk
            usage = out.usage or fallback_usage(job, num_tokens)
            last = _delta_choice(job, text, out.finish_reason or "stop", logprobs, out.stop_reason)
            yield with_ids([last]), usage, num_tokens
            return
        # A chunk per token, as vLLM streams them (one whose characters are not complete yet,
        # or held back as a possible stop string, has empty text): clients count tokens and
        # time their gaps by chunks. A tool call's text is held back whole: no empty chunks.
        if text or logprobs is not None or (calls is None and out.new_token_ids):
            yield with_ids([_delta_choice(job, text, None, logprobs)]), None, num_tokens
        if calls is not None and job.kind == "chat" and not out.finished:
            for delta in calls.call_deltas():  # formats whose calls stream (the generic one)
                yield with_ids([_call_delta_choice(delta, job.index)]), None, num_tokens
        if out.finished:
            usage = out.usage or fallback_usage(job, num_tokens)
            reason = out.finish_reason or "stop"
            if calls is not None:
                rest = calls.finish()
                if rest.content:
                    yield [_delta_choice(job, rest.content, None, None)], None, num_tokens
                for delta in calls.remaining(rest.tool_calls):
                    yield [_call_delta_choice(delta, job.index)], None, num_tokens
                cut = reason == "length" or forced_call_cut(calls.parser, calls.text)
                reason = "tool_calls" if rest.tool_calls and not cut and not _named(job) else reason
            yield with_ids([_delta_choice(job, None, reason, None, out.stop_reason)]), usage, num_tokens  # fmt: skip
            return


def raise_engine_error(error: str | None, finish_reason: str | None) -> None:
    if finish_reason == "abort":  # e.g. the engine is shutting down
        message = f"the request was aborted: {error or 'by the engine'}"
        raise APIError(503, message, type="server_error", code="aborted")
    if error is not None or finish_reason == "error":
        raise server_error(f"generation failed: {error or 'engine error'}")


def _decoder(tokenizer: TokenizerAPI) -> Callable[[list[int]], str]:
    """Token ids to text for logprobs: special tokens kept (a logprob names any token)."""

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=False)

    return decode


def _logprobs(
    job: Job, tokenizer: TokenizerAPI, entries: list[TokenLogprob], offsets: TokenOffsets
) -> dict:
    decode = _decoder(tokenizer)
    if job.kind == "chat":  # every generated token, as vLLM lists them (token_ids align)
        return chat_logprobs(entries, decode, tokenizer.token_bytes)
    return completion_logprobs(entries, decode, offsets, shown=_shown(job, tokenizer))


def _shown(job: Job, tokenizer: TokenizerAPI) -> Callable[[int], bool] | None:
    """Whether a generated token is in the reply's text: not a special token (an end of turn,
    a header marker) that the text skips. None: the text keeps every token."""
    if not job.stream.request.sampling.skip_special_tokens:
        return None
    known: dict[int, bool] = {}

    def shown(token_id: int) -> bool:
        found = known.get(token_id)
        if found is None:
            skipped = tokenizer.decode([token_id], skip_special_tokens=True)
            found = known[token_id] = bool(skipped) or not tokenizer.decode([token_id], False)
        return found

    return shown


def _delta_choice(
    job: Job, text: str | None, finish: str | None, logprobs: Any, stop: int | str | None = None
) -> Any:
    if job.kind == "chat":
        return rt.ChatChunkChoice(job.index, rt.ChatDelta(content=text), finish, logprobs, stop)
    return rt.CompletionChoice(job.index, text or "", finish, logprobs, stop)


def _echoed(job: Job, tokenizer: TokenizerAPI, prompt: list[TokenLogprob | None] | None) -> dict:
    """An echoed prompt's completions logprobs (its first token has none: null, as vLLM).
    Tokens the tokenizer added before the text (a BOS) are not in the echo, so not listed."""
    ids = list(job.stream.request.prompt_token_ids)
    entries = prompt or [None] * len(ids)
    decode = _decoder(tokenizer)
    echo = job.echo or ""
    added = 0  # decoded at most three times, and once where nothing was added
    if decode(ids) != echo:
        added = next((k for k in (1, 2) if k < len(ids) and decode(ids[k:]) == echo), 0)
    out = completion_logprobs(entries[added:], decode, TokenOffsets(decode), ids[added:])
    # Offsets count within the echo, never past it (the completion's start there).
    out["text_offset"] = [min(max(o, 0), len(echo)) for o in out["text_offset"]]
    return out


def _vllm_prompt_logprobs(job: Job, tokenizer: TokenizerAPI, result: Collected) -> Any:
    if job.prompt_logprobs is None:
        return msgspec.UNSET  # not asked: no field (vLLM's clients read it where they asked)
    ids = job.stream.request.prompt_token_ids
    entries = result.prompt_logprobs or [None] * len(ids)
    return vllm_prompt_logprobs(entries, job.prompt_logprobs, _decoder(tokenizer))


def fallback_usage(job: Job, num_tokens: int) -> Usage:
    num_prompt = prompt_count(job)
    return Usage(num_prompt, 0, num_prompt, num_tokens)
