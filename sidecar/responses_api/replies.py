"""Responses API replies from an engine job: the whole ``response`` object, or its semantic
event stream (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``/``.done``,
``response.function_call_arguments.delta``/``.done``, ``response.output_item.done``, then
``response.completed`` or ``response.incomplete``), each event with its ``sequence_number``.

A message item opens at the first released text; tool calls, parsed once generation ends,
follow as ``function_call`` items, their arguments in one delta. A named function's call
(``tool_choice`` naming it) is the whole output, so its arguments stream token by token.
Cut off by ``max_output_tokens``, the open item is ``incomplete``: the message, or a call
whose arguments are no JSON object yet (a forced call stays a call: ``ForcedParser``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from prefixcache.engine.request import Usage

from ..chat.tool_calls import CallDelta, ForcedParser, ToolCall, ToolCallStream, new_call_id
from ..http.errors import APIError
from ..server.responses import (
    Job,
    cache_report,
    cache_write_tokens,
    fallback_usage,
    raise_engine_error,
)
from . import wire as w

log = logging.getLogger("prefixcache.sidecar")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage) -> w.ResponseUsage:
    return w.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=w.InputTokensDetails(usage.cached_tokens, cache_write_tokens(usage)),
        output_tokens=usage.completion_tokens,
        output_tokens_details=w.OutputTokensDetails(),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def function_call(call: ToolCall) -> w.OutputFunctionCall:
    return w.OutputFunctionCall(new_id("fc"), call.id, call.name, call.arguments)


def item_status(finish_reason: str | None) -> str:
    """An output item's status once generation ended: cut off by the limit, ``incomplete``."""
    return "incomplete" if finish_reason == "length" else "completed"


def call_status(arguments: str) -> str:
    """A call whose arguments are no JSON object yet (cut by the limit or a stop string) is
    ``incomplete``."""
    try:
        whole = isinstance(json.loads(arguments), dict)
    except ValueError:
        whole = False
    return "completed" if whole else "incomplete"


def function_calls(calls: list[ToolCall]) -> list[w.OutputFunctionCall]:
    """The calls as items; only the last can be one the limit or a stop string cut."""
    items = [function_call(call) for call in calls]
    if items:
        items[-1].status = call_status(items[-1].arguments)
    return items


def finish(response: w.Response, finish_reason: str, usage: Usage, job: Job) -> w.Response:
    """``response`` at its end: status, usage and the cache report."""
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = w.IncompleteDetails("max_output_tokens")
    else:
        response.status = "completed"
    response.usage = response_usage(usage)
    response.prefixcache = cache_report(usage, job.spans)
    return response


def output_items(job: Job, text: str, finish_reason: str) -> list[w.OutputItem]:
    """The whole output of a non-streamed response."""
    calls: list[ToolCall] = []
    parser = job.tool_parser
    if isinstance(parser, ForcedParser) and parser.function is not None:
        # A named function's arguments are the whole output as generated, as streamed.
        calls, text = [ToolCall(new_call_id(), parser.function, text)], ""
    elif parser is not None:
        parsed = parser.parse(text)
        # A forced output is never text (cut inside its first name, it is no call either);
        # the generic format's is its envelope's response.
        if parsed.tool_calls or parser.rewrites_content:
            calls, text = parsed.tool_calls, parsed.content or ""
    items: list[w.OutputItem] = []
    if text:
        status = "completed" if calls else item_status(finish_reason)
        items.append(w.OutputMessage(new_id("msg"), status, [w.OutputText(text)]))
    items.extend(function_calls(calls))
    return items


def _arguments_delta(
    event: _Events, item: w.OutputFunctionCall, delta: str, finish_reason: str | None
) -> list[bytes]:
    """A named call's arguments so far; once finished (a reason), its ``.done`` events."""
    frames: list[bytes] = []
    ids = {"item_id": item.id, "output_index": 0}
    if delta:
        item.arguments += delta
        frames.append(event("response.function_call_arguments.delta", **ids, delta=delta))
    if finish_reason is not None:
        item.status = call_status(item.arguments)
        done = "response.function_call_arguments.done"
        frames.append(event(done, **ids, name=item.name, arguments=item.arguments))
        frames.append(event("response.output_item.done", output_index=0, item=item))
    return frames


class _Events:
    """Numbers and frames the events of one stream."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


async def stream_events(
    job: Job, response: w.Response, on_done: Callable[[w.Response], None]
) -> AsyncIterator[bytes]:
    """The SSE events of one streamed response; ``on_done`` gets the finished response."""
    event = _Events()
    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    calls = None if job.tool_parser is None else ToolCallStream(job.tool_parser)
    message: w.OutputMessage | None = None
    texts: list[str] = []
    num_tokens = 0

    def open_message() -> list[bytes]:
        nonlocal message
        message = w.OutputMessage(new_id("msg"), "in_progress", [])
        response.output.append(message)
        part = w.OutputText("")
        return [
            event("response.output_item.added", output_index=0, item=message),
            event(
                "response.content_part.added",
                item_id=message.id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def text_delta(text: str) -> list[bytes]:
        frames = open_message() if message is None else []
        assert message is not None
        texts.append(text)
        ids = {"item_id": message.id, "output_index": 0, "content_index": 0}
        frames.append(event("response.output_text.delta", **ids, delta=text, logprobs=[]))
        return frames

    opened: list[w.OutputFunctionCall] = []  # the calls begun so far (streamed as generated)

    def call_frames(delta: CallDelta) -> list[bytes]:
        """A call begun (its item added), or more of its arguments."""
        if delta.id is not None:
            item = w.OutputFunctionCall(new_id("fc"), delta.id, delta.name or "", "", "in_progress")  # fmt: skip
            opened.append(item)
            response.output.append(item)
            index = len(response.output) - 1
            return [event("response.output_item.added", output_index=index, item=item)]
        item = opened[delta.index]
        item.arguments += delta.arguments
        ids = {"item_id": item.id, "output_index": response.output.index(item)}
        return [event("response.function_call_arguments.delta", **ids, delta=delta.arguments)]

    parser = job.tool_parser
    forced: w.OutputFunctionCall | None = None
    if isinstance(parser, ForcedParser) and parser.function is not None:
        # A named function: the grammar makes the whole output its arguments, streamed as
        # they are generated.
        calls = None
        forced = w.OutputFunctionCall(
            new_id("fc"), new_call_id(), parser.function, "", "in_progress"
        )
        response.output.append(forced)
        yield event("response.output_item.added", output_index=0, item=forced)

    try:
        async for out in job.stream:
            raise_engine_error(out.error, out.finish_reason)
            num_tokens += len(out.new_token_ids)
            if forced is not None:
                reason = (out.finish_reason or "stop") if out.finished else None
                for frame in _arguments_delta(event, forced, out.text_delta, reason):
                    yield frame
            else:
                text = out.text_delta if calls is None else calls.push(out.text_delta)
                for frame in text_delta(text) if text else ():
                    yield frame
                if calls is not None and not out.finished:
                    for delta in calls.call_deltas():  # formats whose calls stream (generic)
                        for frame in call_frames(delta):
                            yield frame
            if not out.finished:
                continue
            items: list[w.OutputFunctionCall] = []
            rest_calls: list[ToolCall] = []
            if calls is not None:
                rest = calls.finish()
                for frame in text_delta(rest.content) if rest.content else ():
                    yield frame
                items = function_calls(rest.tool_calls)
                rest_calls = rest.tool_calls
            if message is not None:
                whole = w.OutputText("".join(texts))
                message.content = [whole]
                message.status = "completed" if items else item_status(out.finish_reason)
                ids = {"item_id": message.id, "output_index": 0, "content_index": 0}
                yield event("response.output_text.done", **ids, text=whole.text, logprobs=[])
                yield event("response.content_part.done", **ids, part=whole)
                yield event("response.output_item.done", output_index=0, item=message)
            if calls is not None:
                for delta in calls.remaining(rest_calls):  # what was not streamed yet
                    for frame in call_frames(delta):
                        yield frame
            for item, final in zip(opened, items, strict=True):
                item.arguments, item.status = final.arguments, final.status
                ids = {"item_id": item.id, "output_index": response.output.index(item)}
                yield event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item.name,
                    arguments=item.arguments,
                )
                yield event("response.output_item.done", output_index=ids["output_index"], item=item)  # fmt: skip
            usage = out.usage or fallback_usage(job, num_tokens)
            finish(response, out.finish_reason or "stop", usage, job)
            on_done(response)
            kind = (
                "response.incomplete" if response.status == "incomplete" else "response.completed"
            )
            yield event(kind, response=response)
            return
    except APIError as exc:
        # OpenAI's codes for response.failed name no invalid request: a client's error keeps
        # its own code, else its type (as an HTTP 400's error object has it).
        code = exc.code or ("invalid_request_error" if exc.status < 500 else "server_error")
        response.status = "failed"
        response.error = w.ResponseError(code, exc.message, exc.param, exc.type)
        yield event("error", code=code, message=exc.message, param=exc.param)
        yield event("response.failed", response=response)
    except Exception as exc:
        log.exception("stream %s failed", job.id)
        message_text = f"generation failed: {type(exc).__name__}"
        response.status = "failed"
        response.error = w.ResponseError("server_error", message_text, type="server_error")
        yield event("error", code="server_error", message=message_text, param=None)
        yield event("response.failed", response=response)
