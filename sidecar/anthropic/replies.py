"""Anthropic Messages replies from an engine job: the whole ``message``, or its event stream
(``message_start``, ``ping``, ``content_block_start/delta/stop``, ``message_delta``,
``message_stop``), with Anthropic's cache accounting.

Usage, as Anthropic defines it, from what the engine reports: with ``B`` the end of the last
breakpoint (0 without one) and ``C`` the prompt tokens the engine served from its cache,

- ``cache_read_input_tokens`` = min(C, B): the breakpointed prefix that was already cached;
- ``cache_creation_input_tokens`` = B - min(C, B): the rest of it, written now;
- ``input_tokens`` = prompt - B: the tokens after the last breakpoint.

``B`` goes at most as far as the engine stores the prompt: its whole blocks before its last
token (a partial last block is never stored, the last token always computed), so that an
identical repeat reads all of ``B`` and writes nothing. So the three add up to the prompt,
and a request without a breakpoint reports no cache traffic, as the hosted API would; the
``prefixcache`` extension field keeps the engine's own report (cached tokens, per segment,
by tier). In a stream ``message_start`` leaves with the first token and carries the prompt's
split (see ``start_usage``: exact where the engine's usage has come); ``message_delta`` the
whole usage (Anthropic's ``message_delta`` usage is cumulative).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from prefixcache.engine.request import RequestOutput, RetentionHint, Usage

from ..chat.tool_calls import (
    CallDelta,
    ForcedParser,
    ToolCall,
    ToolCallStream,
    forced_call_cut,
    new_call_id,
)
from ..http.errors import APIError
from ..server.responses import Job, cache_report, fallback_usage, raise_engine_error
from ..wire import reply_types as rt
from .errors import error_body
from .partial_json import partial_object

log = logging.getLogger("prefixcache.sidecar")

_STOP_REASONS = {"length": "max_tokens"}


class CacheCreation(msgspec.Struct):
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = msgspec.field(default_factory=CacheCreation)


class TextContent(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseContent(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class Message(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    role: str = "assistant"
    prefixcache: rt.CacheReport | None = None  # the engine's cache report (extension)


def stored_end(prompt_tokens: int, block_size: int) -> int:
    """How far a repeat of the prompt can be read from the cache: its whole blocks before its
    last token (all of it while the block size is unknown, 0)."""
    if block_size <= 0:
        return prompt_tokens
    return max(prompt_tokens - 1, 0) // block_size * block_size


def message_usage(
    usage: Usage, retain: list[RetentionHint], output_tokens: int, block_size: int
) -> MessageUsage:
    """Anthropic's split of the prompt (see the module docstring)."""
    prompt = usage.prompt_tokens
    # Read: what the engine found, up to the last breakpoint. Written: past that, up to the
    # breakpoints, but only as far as the engine stores (whole blocks), so that an identical
    # repeat reads all that its first request wrote.
    read = min(usage.cached_tokens, max((h.end for h in retain), default=0))
    stored = stored_end(prompt, block_size)
    marks = sorted((min(h.end, stored), h.ttl_s) for h in retain)
    written_to = max(marks[-1][0] if marks else 0, read)
    creation = CacheCreation()
    start = read
    for end, ttl_s in marks:  # the written tokens by the TTL of the breakpoint they fall under
        if end > start:
            if ttl_s >= 3600:
                creation.ephemeral_1h_input_tokens += end - start
            else:
                creation.ephemeral_5m_input_tokens += end - start
            start = end
    return MessageUsage(
        input_tokens=prompt - written_to,
        output_tokens=output_tokens,
        cache_creation_input_tokens=written_to - read,
        cache_read_input_tokens=read,
        cache_creation=creation,
    )


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_use(call: ToolCall) -> ToolUseContent:
    """The call as a block; arguments that max_tokens cut are read as far as they came."""
    return ToolUseContent(tool_use_id(call), call.name, partial_object(call.arguments))


def stop_reason(
    finish: str, tool_calls: bool, engine_stop: int | str | None
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for an engine finish reason and its
    ``stop_reason`` (the stop string that ended the output, or a stop token's id)."""
    if tool_calls:
        return "tool_use", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return _STOP_REASONS.get(finish, "end_turn"), None


def whole_message(
    job: Job,
    text: str,
    finish: str,
    usage: Usage,
    token_ids: list[int],
    engine_stop: int | str | None,
    block_size: int,
) -> Message:
    content: list[TextContent | ToolUseContent] = []
    calls: list[ToolCall] = []
    cut = forced_call_cut(job.tool_parser, text)
    if job.tool_parser is not None:
        parsed = job.tool_parser.parse(text)
        calls = parsed.tool_calls
        if calls or job.tool_parser.rewrites_content:  # never a forcing JSON or envelope
            text = parsed.content or ""
    if text:
        content.append(TextContent(text))
    content.extend(tool_use(call) for call in calls)
    reason, sequence = stop_reason(finish, bool(calls) and not cut, engine_stop)
    return Message(
        id=job.id,
        model=job.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=message_usage(usage, job.retain, len(token_ids), block_size),
        prefixcache=cache_report(usage, job.spans),
    )


def event(kind: str, **fields: Any) -> bytes:
    """One SSE event: its name, and the same ``type`` in its data (Anthropic's framing)."""
    data = msgspec.json.encode({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def stream_events(job: Job, block_size: int) -> AsyncIterator[bytes]:
    """The SSE events of one streamed message. Nothing leaves before the first token (a client
    times its first token by the first event, as the chat stream's first chunk): then
    ``message_start``, with the prompt's usage as the whole message will report it."""
    try:
        outputs = aiter(job.stream)
        first = await anext(outputs, None)
        if first is None:
            return
        raise_engine_error(first.error, first.finish_reason)
        start = Message(
            id=job.id,
            model=job.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=start_usage(job, first, block_size),
        )
        yield event("message_start", message=start) + event("ping")
        parser = job.tool_parser
        forced = parser.function if isinstance(parser, ForcedParser) else None
        rest = _chain(first, outputs)
        body = (
            _forced_call_events(job, rest, forced, block_size)
            if forced
            else _content_events(job, rest, block_size)
        )
        async with contextlib.aclosing(body) as frames:
            async for frame in frames:
                yield frame
    except APIError as exc:
        yield event("error", error=error_body(exc)["error"])
    except Exception as exc:
        log.exception("stream %s failed", job.id)
        message = f"generation failed: {type(exc).__name__}"
        yield event("error", error={"type": "api_error", "message": message})


def start_usage(job: Job, first: RequestOutput, block_size: int) -> MessageUsage:
    """``message_start``'s usage: the prompt's split as the whole message reports it (the
    engine's first output carries the prompt's usage), and the output so far. An engine that
    does not report it early (a test's stand-in): what the sidecar knows at submit time,
    ``input_tokens`` past the last stored breakpoint and the breakpointed prefix as written."""
    output = len(first.new_token_ids)
    if first.usage is not None:
        if first.finished:
            output = first.usage.completion_tokens
        return message_usage(first.usage, job.retain, output, block_size)
    prompt = len(job.stream.request.prompt_token_ids)
    return message_usage(Usage(prompt_tokens=prompt), job.retain, output, block_size)


async def _chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def _content_events(
    job: Job, outputs: AsyncIterator[RequestOutput], block_size: int
) -> AsyncIterator[bytes]:
    """Text as it comes (less what could start a tool call), then the tool calls: as they
    are generated where the format streams them (the generic one), else once parsed."""
    calls = None if job.tool_parser is None else ToolCallStream(job.tool_parser)
    index = 0
    text_open = False
    call_open = False  # a tool_use block is open (at ``index``)
    released: list[str] = []
    token_ids: list[int] = []

    def call_events(delta: CallDelta) -> list[bytes]:
        """A call begun (the open block stopped, its tool_use block started) or more of its
        input JSON."""
        nonlocal index, text_open, call_open
        frames = []
        if delta.id is not None:
            if text_open or call_open:
                frames.append(event("content_block_stop", index=index))
                index += 1
                text_open = False
            head = ToolUseContent(tool_use_id(ToolCall(delta.id, "", "")), delta.name or "", {})
            frames.append(_block_start(index, head))
            call_open = True
        elif delta.arguments:
            json_delta = {"type": "input_json_delta", "partial_json": delta.arguments}
            frames.append(event("content_block_delta", index=index, delta=json_delta))
        return frames

    async for out in outputs:
        raise_engine_error(out.error, out.finish_reason)
        token_ids.extend(out.new_token_ids)
        text = out.text_delta if calls is None else calls.push(out.text_delta)
        if text:
            if not text_open:
                yield _block_start(index, TextContent(""))
                text_open = True
            released.append(text)
            yield event("content_block_delta", index=index, delta=_text_delta(text))
        if calls is not None and not out.finished:
            for delta in calls.call_deltas():  # formats whose calls stream (the generic one)
                for frame in call_events(delta):
                    yield frame
        if not out.finished:
            continue
        tool_calls: list[ToolCall] = []
        if calls is not None:
            rest = calls.finish()
            if rest.content:
                if not text_open:
                    yield _block_start(index, TextContent(""))
                    text_open = True
                released.append(rest.content)
                yield event("content_block_delta", index=index, delta=_text_delta(rest.content))
            tool_calls = rest.tool_calls
            for delta in calls.remaining(tool_calls):
                for frame in call_events(delta):
                    yield frame
        if text_open or call_open:
            yield event("content_block_stop", index=index)
            index += 1
        finish = out.finish_reason or "stop"
        cut = calls is not None and forced_call_cut(job.tool_parser, calls.text)
        reason, sequence = stop_reason(finish, bool(tool_calls) and not cut, out.stop_reason)
        usage = out.usage or fallback_usage(job, len(token_ids))
        yield _message_end(job, usage, reason, sequence, len(token_ids), block_size)
        return


async def _forced_call_events(
    job: Job,
    outputs: AsyncIterator[RequestOutput],
    name: str,
    block_size: int,
) -> AsyncIterator[bytes]:
    """``tool_choice`` naming a tool: the grammar makes the whole output the call's input
    JSON, so it streams as ``input_json_delta``s while it is generated."""
    head = ToolUseContent(tool_use_id(ToolCall(new_call_id(), name, "{}")), name, {})
    yield _block_start(0, head)
    parts: list[str] = []
    token_ids: list[int] = []
    async for out in outputs:
        raise_engine_error(out.error, out.finish_reason)
        token_ids += out.new_token_ids
        if out.text_delta:
            parts.append(out.text_delta)
            delta = {"type": "input_json_delta", "partial_json": out.text_delta}
            yield event("content_block_delta", index=0, delta=delta)
        if out.finished:
            yield event("content_block_stop", index=0)
            assert job.tool_parser is not None
            text, finish = "".join(parts), out.finish_reason or "stop"
            called = bool(job.tool_parser.parse(text).tool_calls)
            called = called and not forced_call_cut(job.tool_parser, text)
            reason, sequence = stop_reason(finish, called, out.stop_reason)
            usage = out.usage or fallback_usage(job, len(token_ids))
            yield _message_end(job, usage, reason, sequence, len(token_ids), block_size)
            return


def _message_end(
    job: Job,
    usage: Usage,
    reason: str,
    sequence: str | None,
    output_tokens: int,
    block_size: int,
) -> bytes:
    """``message_delta`` (the stop reason and the whole usage) and ``message_stop``."""
    delta = event(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": sequence},
        usage=message_usage(usage, job.retain, output_tokens, block_size),
        prefixcache=cache_report(usage, job.spans),
    )
    return delta + event("message_stop")


def _block_start(index: int, block: TextContent | ToolUseContent) -> bytes:
    return event("content_block_start", index=index, content_block=block)


def _text_delta(text: str) -> dict[str, str]:
    return {"type": "text_delta", "text": text}
