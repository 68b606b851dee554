"""Tools for a chat template that does not render them: the generic JSON format.

A template that ignores ``tools`` (SmolLM2's, Gemma's, many older chat models') can show the
model neither its tools nor its own past calls. Instead of refusing, the prompt carries them
as text, in the spirit of llama.cpp's "generic" format:

- the tools and the reply format join the first system message (a new one if there is none);
  the same tools always give the same text (canonical JSON), so that prefix is cached;
- the history is rewritten into that format, compact as the grammar writes it: an
  assistant's calls become ``{"tool_calls":[...]}`` (their arguments as the client sent them
  back: the reply's own text), its answers ``{"response":...}``, so a conversation's next turn
  holds the last reply's tokens as generated; a tool's result becomes a user turn of
  ``{"tool_response":...}``, named by the call of the latest assistant turn with its id (tool
  roles the template may not know; a run of them one turn);
- a grammar holds the reply to one of the two envelopes (``tool_choice`` auto), or to the
  calls alone (required; named: one call of that function), so every turn reads alike.
  ``none`` is the plain prompt, as before: no call is wanted, and the answer is the model's
  own text (what LangChain sends with tools bound);
- ``GenericParser`` reads the envelope back as tool calls or content; a stream releases the
  response's text as it decodes, and each call (``calls_in``) as it is generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .tool_calls import (
    ParsedOutput,
    ToolCall,
    WholeOutputParser,
    call_of,
    content_of,
    json_text,
    new_call_id,
)

_INSTRUCTIONS = (
    "Reply with one JSON object and nothing else: "
    '{"tool_calls": [{"name": <a tool\'s name>, "arguments": <its arguments object>}]} '
    'to call tools, or {"response": <your reply>} to answer. A tool\'s result comes back as '
    '{"tool_response": {"name": <the tool\'s name>, "content": <its result>}}.'
)


@dataclass(slots=True, frozen=True)
class GenericTools:
    """One request's tools (canonical dicts, as the template would have seen them)."""

    tools: list[dict[str, Any]]

    def system_text(self) -> str:
        lines = ["You can call these tools (each one's arguments as a JSON Schema):"]
        for tool in self.tools:
            function = tool.get("function", {})
            lines.append(json.dumps(function, ensure_ascii=False, separators=(", ", ": ")))
        lines.append(_INSTRUCTIONS)
        return "\n".join(lines)

    def messages(
        self,
        messages: list[dict[str, Any]],
        merge: bool = True,
        arguments: list[list[str] | None] | None = None,
    ) -> list[dict[str, Any]]:
        """``messages`` (the template's dicts) in the generic format. ``merge``: a run of
        user turns that tool results joined becomes one (templates that need roles to
        alternate); off for tagged segments, whose pieces stay one per segment.
        ``arguments``: per message, its calls' arguments as the client sent them (JSON text:
        the reply's own, so the history reads as the model wrote it)."""
        out: list[dict[str, Any]] = []
        joined = False  # whether out[-1] is a user turn a tool result made or joined
        names: dict[str, str] = {}  # call id -> function, the latest assistant turn's first
        for i, m in enumerate(messages):
            role = m["role"]
            if i == 0 and role == "system":
                out.append({**m, "content": f"{m['content']}\n\n{self.system_text()}"})
                continue
            if i == 0:
                out.append({"role": "system", "content": self.system_text()})
            if role == "assistant":
                sent = arguments[i] if arguments is not None else None
                out.append({"role": "assistant", "content": assistant_envelope(m, sent)})
                names.update({c["id"]: c["function"]["name"] for c in m.get("tool_calls") or ()})
                joined = False
            elif role == "tool":
                name = names.get(m.get("tool_call_id") or "", m.get("name"))
                text = json_text({"tool_response": {"name": name, "content": m["content"]}}, COMPACT)  # fmt: skip
                if merge and joined:
                    out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{text}"}
                else:
                    out.append({"role": "user", "content": text})
                joined = True
            elif role == "user" and merge and joined:
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{m['content']}"}
            else:
                out.append(m)
                joined = False
        return out


COMPACT = (",", ":")  # how the grammar writes JSON (no free whitespace)


def assistant_envelope(message: dict[str, Any], arguments: list[str] | None = None) -> str:
    """A past assistant turn as the generic format writes it: compact, the calls' arguments
    as sent (``arguments``; else their objects), so a reply sent back reads as generated."""
    calls = message.get("tool_calls")
    if not calls:
        return json_text({"response": message.get("content") or ""}, COMPACT)
    items = []
    for k, call in enumerate(calls):
        name = json_text(call["function"]["name"], COMPACT)
        args = arguments[k] if arguments is not None and arguments[k].strip() else None
        if args is None:
            args = json_text(call["function"]["arguments"], COMPACT)
        items.append(f'{{"name":{name},"arguments":{args}}}')
    head = f'"response":{json_text(message["content"], COMPACT)},' if message.get("content") else ""
    return f'{{{head}"tool_calls":[{",".join(items)}]}}'


def envelope_schema(
    tools: list[tuple[str, dict[str, Any]]], single: bool, response: dict[str, Any] | None
) -> dict[str, Any]:
    """The reply's JSON Schema: ``{"tool_calls": [...]}`` of ``tools`` (name, parameters;
    at most one call with ``single``) or, where ``response`` is given (tool_choice auto),
    ``{"response": <response>}``. ValueError if two of them define a ``$defs`` name
    differently."""
    defs = SchemaDefs()
    at = "#/anyOf/0/properties/tool_calls/items/anyOf" if response is not None else "#/properties/tool_calls/items/anyOf"  # fmt: skip
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": defs.lift(parameters, f"{at}/{i}/properties/arguments"),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, (name, parameters) in enumerate(tools)
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if single:
        array["maxItems"] = 1
    if response is None:  # a call is required (or named)
        return defs.into(_object("tool_calls", array))
    answer = _object("response", defs.lift(response, "#/anyOf/1/properties/response"))
    return defs.into({"anyOf": [_object("tool_calls", array), answer]})


class SchemaDefs:
    """Definitions of schemas nested in a bigger one, lifted to its root, where their
    ``#/$defs/...`` references point (pydantic writes them so); as vLLM, a name two schemas
    define differently is refused."""

    KEYWORDS = ("$defs", "definitions")

    def __init__(self) -> None:
        self.found: dict[str, dict[str, Any]] = {}

    def lift(self, schema: dict[str, Any], at: str) -> dict[str, Any]:
        """``schema``, placed at the JSON pointer ``at`` of the whole, without its definitions
        (they join the root's); its other local references (``#``, ``#/properties/...``) now
        point where it lies."""
        schema = _rebased(schema, at)
        if not any(key in schema for key in self.KEYWORDS):
            return schema
        rest = dict(schema)
        for key in self.KEYWORDS:
            defined = rest.pop(key, None)
            if not isinstance(defined, dict):
                continue
            have = self.found.setdefault(key, {})
            for name, definition in defined.items():
                if have.setdefault(name, definition) != definition:
                    raise ValueError(
                        f"two schemas define {key} {name!r} differently; one grammar holds "
                        "them all, so each name must have one definition"
                    )
        return rest

    def into(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {**schema, **self.found} if self.found else schema


def _rebased(value: Any, at: str) -> Any:
    """``value`` with each local ``$ref`` outside the definitions made relative to ``at``."""
    if isinstance(value, list):
        return [_rebased(v, at) for v in value]
    if not isinstance(value, dict):
        return value
    out = {key: _rebased(v, at) for key, v in value.items()}
    ref = out.get("$ref")
    local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
    if local and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = at + ref[1:]
    return out


def _object(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: value},
        "required": [key],
        "additionalProperties": False,
    }


# Where the response's value begins: a string's first character (after its quote), or, for a
# structured response (response_format), the value itself.
_RESPONSE_STRING = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_RESPONSE_VALUE = re.compile(r'\s*\{\s*"response"\s*:\s*')
_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CALL_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_CALL_END = re.compile(r"\s*\}\s*([,\]])")  # after the arguments: the call's end, then , or ]
_DECODER = json.JSONDecoder()


def calls_in(text: str) -> list[tuple[str, str]]:
    """The calls of an envelope (whole or cut) that have begun: each one's name, once whole,
    and its arguments' text as far as it came; an argument object's end ends its text, so a
    longer output only adds to it."""
    start = _CALLS.match(text)
    if start is None:
        return []
    out: list[tuple[str, str]] = []
    at = start.end()
    while (head := _CALL_NAME.match(text, at)) is not None:
        try:
            name = json.loads(head.group(1))
        except ValueError:  # a name the grammar never writes
            return out
        arguments = _CALL_ARGUMENTS.match(text, head.end())
        if arguments is None:  # cut before its arguments began
            out.append((name, ""))
            return out
        try:
            _, end = _DECODER.raw_decode(text, arguments.end())
        except ValueError:  # the arguments still coming
            out.append((name, text[arguments.end() :]))
            return out
        out.append((name, text[arguments.end() : end]))
        tail = _CALL_END.match(text, end)
        if tail is None or tail.group(1) == "]":
            return out
        at = tail.end()
    return out


class GenericParser(WholeOutputParser):
    """The generic format's reply: ``{"tool_calls": [...]}`` or ``{"response": ...}``.

    ``structured``: the response is a JSON value (response_format), whose text is the
    content; else a string, whose characters are. Output that is neither envelope (a cut
    one) is the response as far as it came."""

    name = "generic"

    def __init__(self, structured: bool = False, function: str | None = None) -> None:
        self.structured = structured
        self.function = function  # tool_choice named this function (its call finishes "stop")

    def parse_calls(self, section: str) -> list[ToolCall]:
        """The envelope's calls, each one's arguments as generated (the text the stream sent
        and the history will hold)."""
        value = json.loads(section)
        if not isinstance(value, dict) or not isinstance(value.get("tool_calls"), list):
            raise ValueError("not a tool call envelope")
        begun = calls_in(section)
        if len(begun) != len(value["tool_calls"]):
            raise ValueError("not the envelope the grammar writes")
        calls = []
        for item, (_, text) in zip(value["tool_calls"], begun, strict=True):
            if not isinstance(item, dict):
                raise ValueError("a tool call must be a JSON object")
            call = call_of(item.get("name"), item.get("arguments"))  # checked: an object
            calls.append(ToolCall(call.id, call.name, text))
        return calls

    def calls_so_far(self, text: str) -> list[tuple[str, str]]:
        return calls_in(text)

    def parse(self, text: str) -> ParsedOutput:
        try:
            return ParsedOutput(None, self.parse_calls(text))
        except ValueError:
            pass
        if _CALLS.match(text) is not None:  # cut in its calls: the whole ones, the last so far
            return ParsedOutput(None, [ToolCall(new_call_id(), n, a) for n, a in calls_in(text)])
        return ParsedOutput(content_of(self.streamed_content(text, final=True)))

    def streamed_content(self, text: str, final: bool = False) -> str:
        """The response's text that ``text`` holds for sure (more text only adds to it);
        ``final``: the whole output, nothing to hold back."""
        if self.structured:
            start = _RESPONSE_VALUE.match(text)
            if start is None:
                return ""
            value = text[start.end() :]
            try:  # whole: exactly the value's text
                _, end = _DECODER.raw_decode(value)
                return value[:end]
            except ValueError:  # the envelope's closing brace may be next: hold it back
                return value if final else value.rstrip(" \t\r\n}")
        start = _RESPONSE_STRING.match(text)
        return "" if start is None else _string_so_far(text[start.end() :])


def _string_so_far(body: str) -> str:
    """The characters of a JSON string's body (from after its opening quote) up to its end or
    the last one whose escape is whole (a surrogate pair waits for its second half)."""
    i, safe, n = 0, 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            break
        if c == "\\":
            if i + 1 >= n:
                break
            if body[i + 1] == "u":
                try:
                    code = int(body[i + 2 : i + 6], 16) if i + 6 <= n else None
                except ValueError:
                    break
                if code is None:
                    break
                step = 12 if 0xD800 <= code < 0xDC00 else 6
                if i + step > n:
                    break
                i += step
            else:
                i += 2
        else:
            i += 1
        safe = i
    try:
        return json.loads(f'"{body[:safe]}"')
    except ValueError:  # not JSON the grammar would write
        return ""
