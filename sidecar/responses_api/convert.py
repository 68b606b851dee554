"""A Responses API request as the chat request the engine path serves.

``instructions`` is a system message in front (not carried over by ``previous_response_id``,
as OpenAI's); a string ``input`` is one user message; message items keep their role
(``developer`` is the system role), ``function_call`` items become the ``tool_calls`` of an
assistant turn (consecutive ones one turn), ``function_call_output`` items ``tool`` messages
(each answering a ``function_call`` of the input or the stored conversation, as OpenAI asks).
Errors name the Responses request's fields, also those the chat path's checks raise.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..http.errors import APIError
from ..wire import protocol as p
from ..wire.prompt_parts import FunctionCall, TextPart, ToolCallItem
from ..wire.tool_requests import (
    ChosenFunction,
    FunctionDef,
    JSONSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ToolDef,
)
from . import wire as w

NO_EFFORT = (None, "", "none")
_REFUSED = ("reasoning", "background", "conversation", "prompt", "top_logprobs", "max_tool_calls")


def check_unsupported(req: w.ResponsesRequest) -> None:
    for name in _REFUSED:
        value = getattr(req, name)
        if value is None or value is False or value == 0:
            continue
        if name == "reasoning" and isinstance(value, dict) and value.get("effort") in NO_EFFORT:
            continue  # {}, {"effort": null} or "none": no reasoning asked for
        raise p.Error(f"'{name}' is not supported by this server", name)
    if "message.output_text.logprobs" in (req.include or ()):  # it answered [] for them
        raise p.Error("include 'message.output_text.logprobs' is not supported", "include")
    for tool in req.tools or ():
        if tool.type != "function":
            shown = repr(tool.type)[:40]
            raise p.Error(f"tool type {shown} is not supported: only 'function'", "tools")
        if tool.name is None:
            raise p.Error("a function tool needs 'name'", "tools")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and (fmt.name is None or fmt.schema is None):
        raise p.Error("text.format json_schema needs 'name' and 'schema'", "text.format")


def input_messages(req: w.ResponsesRequest) -> list[p.Message]:
    """The conversation items of ``req.input`` as chat messages."""
    if isinstance(req.input, str):
        return [p.Message("user", req.input)]
    messages: list[p.Message] = []
    for index, raw in enumerate(req.input):
        kind = raw.get("type", "message")
        try:
            if kind == "message":
                item = msgspec.convert(raw, w.MessageItem)
                messages.append(p.Message(item.role, _text(item.content, index)))
            elif kind == "function_call":
                call = msgspec.convert(raw, w.FunctionCallItem)
                _check_arguments(call.arguments, index)
                tool_call = ToolCallItem(call.call_id, FunctionCall(call.name, call.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or ()), tool_call]
                else:
                    messages.append(p.Message("assistant", "", tool_calls=[tool_call]))
            elif kind == "function_call_output":
                result = msgspec.convert(raw, w.FunctionCallOutputItem)
                text = _text(result.output, index)
                messages.append(p.Message("tool", text, tool_call_id=result.call_id))
            else:
                shown = repr(kind)[:40] if isinstance(kind, str) else "a non-string"
                raise p.Error(f"input[{index}]: items of type {shown} are not supported", "input")
        except msgspec.ValidationError as exc:
            raise p.Error(f"input[{index}]: {_without_values(str(exc))}", "input") from None
    if not messages:
        raise p.Error("'input' must not be empty", "input")
    return messages


def _check_arguments(arguments: str, index: int) -> None:
    if p.arguments_object(arguments) is None:
        message = f"input[{index}]: 'arguments' must be the JSON text of an object"
        raise p.Error(message, f"input[{index}].arguments")


def _check_call_outputs(messages: list[p.Message]) -> None:
    """Every tool result answers a call of the conversation (OpenAI's check and words)."""
    calls = {call.id for message in messages for call in message.tool_calls or ()}
    for message in messages:
        if message.role == "tool" and message.tool_call_id not in calls:
            call_id = (message.tool_call_id or "")[:128]
            raise p.Error(
                f"No tool call found for function call output with call_id {call_id}.", "input"
            )


def _text(content: str | list[w.ContentPart], index: int) -> str | list[TextPart]:
    """The item's text; as text parts where one carries a ``prompt_cache_breakpoint`` (the
    renderer turns it into a retention hint, as on chat; the prompt is the same)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type in ("input_text", "output_text"):
            text = part.text or ""
        elif part.type == "refusal":
            text = part.refusal or ""
        else:
            shown = repr(part.type)[:40]
            raise p.Error(f"input[{index}]: {shown} content is not supported", "input")
        parts.append(TextPart("text", text, prompt_cache_breakpoint=part.prompt_cache_breakpoint))
    if any(part.prompt_cache_breakpoint is not None for part in parts):
        return parts
    return "\n".join(part.text for part in parts)


def _without_values(message: str) -> str:
    return message.split(" - at ", 1)[0] if "Invalid enum value" in message else message


def chat_request(req: w.ResponsesRequest, history: list[p.Message]) -> p.ChatCompletionRequest:
    """``history`` (earlier turns, from ``previous_response_id``) and this input."""
    messages = [*history, *input_messages(req)]
    _check_call_outputs(messages)
    if req.instructions:
        messages.insert(0, p.Message("system", req.instructions))
    tools = [
        ToolDef("function", FunctionDef(t.name or "", t.description, t.parameters, t.strict))
        for t in req.tools or ()
    ]
    choice: Any = req.tool_choice
    if isinstance(choice, w.NamedFunction):
        choice = NamedToolChoice("function", ChosenFunction(choice.name))
    return p.ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=bool(req.stream),
        user=req.safety_identifier or req.user,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req),
        cache_salt=req.cache_salt,
    )


def _response_format(req: w.ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return ResponseFormat(fmt.type)
    assert fmt.name is not None
    return ResponseFormat(
        "json_schema", JSONSchemaFormat(fmt.name, fmt.schema, fmt.description, fmt.strict)
    )


# The chat request's fields, as the Responses request names them.
_FIELDS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "segments": "input",
    "response_format": "text.format",
}


def renamed(exc: APIError) -> APIError:
    """An error of the chat path naming the Responses request's field instead of its own."""
    field = _FIELDS.get(exc.param or "")
    if field is not None:
        exc.message = exc.message.replace(f"{exc.param}=", f"{field}=")
        exc.param = field
    if exc.code == "context_length_exceeded":  # its sentences name the prompt's parts too
        for chat, responses in (("max_tokens", "max_output_tokens"), ("messages", "input")):
            exc.message = exc.message.replace(chat, responses)
    return exc
