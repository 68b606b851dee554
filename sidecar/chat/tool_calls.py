"""Model output → OpenAI ``tool_calls``: one parser per tool-call format, whole or streamed.

Formats (named as vLLM's ``--tool-call-parser``):

- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text before the first block is content.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the whole output is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``), several calls separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (newer
  tokenizers) ``name[ARGS]{...}`` per call; text before the marker is content.

Output that does not parse as the format's calls is plain content, never an error. A
``ToolCallStream`` releases content as it comes, holds back what could start a tool-call
section, and parses the section once generation ends, so a stream and a whole reply agree.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_text(value: Any, separators: tuple[str, str] = (", ", ": ")) -> str:
    """``value`` as JSON text, its characters as they are; escaped where it holds a lone
    surrogate (``"\\ud800"`` read from JSON text), which no UTF-8 encoder takes."""
    text = json.dumps(value, ensure_ascii=False, separators=separators)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=separators)
    return text


def call_of(name: Any, arguments: Any, separators: tuple[str, str] = (", ", ": ")) -> ToolCall:
    """One call from decoded JSON; ValueError unless a name and an object of arguments."""
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a name")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models put the arguments' JSON text in a string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return ToolCall(new_call_id(), name, json_text(arguments, separators))


def content_of(text: str) -> str | None:
    return text if text.strip() else None


class ToolCallParser:
    """A format: where a tool-call section starts, and how a whole output parses."""

    name = ""
    needs_special_tokens = False  # its markers are special tokens the detokenizer would drop
    # A reply's content is parse()'s, never the raw output (a forced call's JSON, the generic
    # format's envelope), even when it holds no call.
    rewrites_content = False

    def streamed_content(self, text: str, final: bool = False) -> str | None:
        """Formats whose content lies inside the output (the generic envelope): the content
        that ``text`` holds for sure; None: content is the output's own text, released as
        ``section_start`` and ``held_back`` allow."""
        return None

    def calls_so_far(self, text: str) -> list[tuple[str, str]] | None:
        """Formats whose calls stream (the generic envelope): each call ``text`` has begun,
        as (its name, its arguments' text so far: more text only adds to it); None: the
        calls come whole once the output ends."""
        return None

    def section_start(self, text: str) -> int | None:
        """Where the tool-call section begins in ``text`` (so far), or None."""
        raise NotImplementedError

    def held_back(self, text: str) -> int:
        """How many trailing characters could still begin a section (not content yet)."""
        raise NotImplementedError

    def parse_calls(self, section: str) -> list[ToolCall]:
        """The calls in a section; ValueError if it is not well formed."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        at = self.section_start(text)
        if at is None:
            return ParsedOutput(content_of(text))
        try:
            calls = self.parse_calls(text[at:])
        except ValueError:  # json.JSONDecodeError is one
            return ParsedOutput(content_of(text))
        if not calls:
            return ParsedOutput(content_of(text))
        return ParsedOutput(content_of(text[:at]), calls)


class MarkerParser(ToolCallParser):
    """Formats whose section starts at a marker anywhere in the output."""

    marker = ""

    def section_start(self, text: str) -> int | None:
        at = text.find(self.marker)
        return None if at < 0 else at

    def held_back(self, text: str) -> int:
        for n in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-n:]):
                return n
        return 0


_DECODER = json.JSONDecoder()


class HermesParser(MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    _END = "</tool_call>"

    def parse_calls(self, section: str) -> list[ToolCall]:
        calls = []
        rest = section
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(self.marker):
                raise ValueError("text between tool calls")
            body = rest[len(self.marker) :]
            end = body.find(self._END)
            inner, rest = (body, "") if end < 0 else (body[:end], body[end + len(self._END) :])
            obj = json.loads(inner)
            if not isinstance(obj, dict):
                raise ValueError("a tool call must be a JSON object")
            calls.append(call_of(obj.get("name"), obj.get("arguments")))
        return calls


class MistralParser(MarkerParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True
    _ARGS = "[ARGS]"

    def parse_calls(self, section: str) -> list[ToolCall]:
        calls = []
        for part in section.split(self.marker)[1:]:
            part = part.strip()
            if part.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
                items = json.loads(part)
                if not isinstance(items, list):
                    raise ValueError("[TOOL_CALLS] must be followed by a list")
                for item in items:
                    if not isinstance(item, dict):
                        raise ValueError("a tool call must be a JSON object")
                    calls.append(call_of(item.get("name"), item.get("arguments")))
            elif self._ARGS in part:  # name[ARGS]{...}
                name, _, arguments = part.partition(self._ARGS)
                calls.append(call_of(name.strip(), json.loads(arguments)))
            else:
                raise ValueError("not a tool call")
        return calls


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|>
    _TAG = "<|python_tag|>"

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("{", self._TAG)):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if self._TAG.startswith(stripped) else 0  # "" or a part of the tag

    def parse_calls(self, section: str) -> list[ToolCall]:
        rest = section.strip().removeprefix(self._TAG).strip()
        calls = []
        while rest:
            obj, end = _DECODER.raw_decode(rest)
            if not isinstance(obj, dict):
                raise ValueError("a tool call must be a JSON object")
            arguments = obj.get("parameters", obj.get("arguments"))
            calls.append(call_of(obj.get("name"), arguments))
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                raise ValueError("text after a tool call")
        return calls


class WholeOutputParser(ToolCallParser):
    """Formats a grammar forced on the whole output (a forced call's JSON, the generic
    format's envelope): it is all one section, and a reply's content is never its raw text."""

    rewrites_content = True

    def section_start(self, text: str) -> int | None:
        return 0

    def held_back(self, text: str) -> int:
        return 0


class ForcedParser(WholeOutputParser):
    """``tool_choice`` required or named: the output is JSON the grammar forced, not the
    model's own format. Named: the arguments object; required: a list of
    ``{"name", "parameters"}`` (as vLLM forces them)."""

    name = "forced"

    def __init__(self, function: str | None) -> None:
        self.function = function  # the named function, or None for "required"

    def parse_calls(self, section: str) -> list[ToolCall]:
        value = json.loads(section)
        if self.function is not None:
            return [call_of(self.function, value)]
        if not isinstance(value, list):
            raise ValueError("expected a list of tool calls")
        return [call_of(item.get("name"), item.get("parameters")) for item in value]

    def parse(self, text: str) -> ParsedOutput:
        """The forced calls; output the grammar forced but max_tokens cut is still calls (as
        a stream of them would have shown): the whole ones, then the last with its arguments
        as far as they came (OpenAI's arguments are text), never the forcing JSON as content."""
        parsed = super().parse(text)
        if parsed.tool_calls or not text.strip():
            return parsed
        if self.function is not None:
            return ParsedOutput(None, [ToolCall(new_call_id(), self.function, text.strip())])
        return ParsedOutput(None, cut_calls(text))


class FirstCallOnly(ToolCallParser):
    """``parallel_tool_calls: false`` under ``tool_choice`` auto: the model's format, its first
    call kept (OpenAI promises at most one; vLLM keeps the first too). Required is held to one
    by its grammar, a named call is one."""

    def __init__(self, inner: ToolCallParser) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_special_tokens = inner.needs_special_tokens

    def section_start(self, text: str) -> int | None:
        return self.inner.section_start(text)

    def held_back(self, text: str) -> int:
        return self.inner.held_back(text)

    def parse_calls(self, section: str) -> list[ToolCall]:
        return self.inner.parse_calls(section)[:1]

    def parse(self, text: str) -> ParsedOutput:
        parsed = self.inner.parse(text)
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])


def forced_call_cut(parser: ToolCallParser | None, text: str) -> bool:
    """Whether ``text`` is calls a grammar forced (a forced call's JSON, the generic format's
    envelope) cut before their JSON ended (by max_tokens or a stop string): the reply says
    what cut it (length, stop), not that the calls were made."""
    if not isinstance(parser, WholeOutputParser):
        return False
    try:
        return not parser.parse_calls(text)
    except ValueError:
        return True


# The forced list's last, cut call: its name whole, then its parameters' text as far as they
# came (none if the cut fell before them).
_CUT_CALL = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*(?:,\s*"parameters"\s*:(.*))?', re.S
)


def cut_calls(text: str) -> list[ToolCall]:
    """The calls of a forced ``[{"name", "parameters"}, ...]`` list that max_tokens cut."""
    rest = text.strip().removeprefix("[")
    calls: list[ToolCall] = []
    while rest.strip():
        try:
            item, end = _DECODER.raw_decode(rest.lstrip())
        except ValueError:
            cut = _CUT_CALL.match(rest)
            if cut is not None:
                with contextlib.suppress(ValueError):  # a name the grammar would not write
                    name = json.loads(f'"{cut.group(1)}"')
                    calls.append(ToolCall(new_call_id(), name, (cut.group(2) or "").strip()))
            break
        if not isinstance(item, dict):
            break
        try:
            calls.append(call_of(item.get("name"), item.get("parameters")))
        except ValueError:  # not a call: what came so far is all there is
            break
        rest = rest.lstrip()[end:].lstrip().removeprefix(",")
    return calls


PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)
}


def parser_named(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
        ) from None


def parser_for_rendering(rendered: str) -> ToolCallParser:
    """The format a template writes an assistant tool call in (its own history shows it)."""
    if HermesParser.marker in rendered:
        return HermesParser()
    if MistralParser.marker in rendered:
        return MistralParser()
    if '"parameters"' in rendered or Llama3JsonParser._TAG in rendered:
        return Llama3JsonParser()
    return HermesParser()  # the most common format in open models


class ToolCallStream:
    """Streamed text in, content deltas out; the tool calls once the stream ends."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.emitted = 0  # characters of ``text`` released as content
        self.in_section = False
        self.call_ids: list[str] = []  # the calls streamed so far
        self.sent: list[int] = []  # characters of each one's arguments streamed

    def push(self, delta: str) -> str:
        """The content that can be released now."""
        self.text += delta
        inner = self.parser.streamed_content(self.text)
        if inner is not None:
            out = inner[self.emitted :]
            self.emitted = max(self.emitted, len(inner))
            return out
        if self.in_section:
            return ""
        at = self.parser.section_start(self.text)
        if at is not None:
            self.in_section = True
            upto = max(at, self.emitted)
        else:
            upto = len(self.text) - self.parser.held_back(self.text)
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out

    def call_deltas(self) -> list[CallDelta]:
        """Where the format streams its calls: what is new since the last time, a call begun
        (its id and name, as OpenAI streams them first) and its arguments' next characters."""
        begun = self.parser.calls_so_far(self.text)
        out: list[CallDelta] = []
        for i, (name, arguments) in enumerate(begun or ()):
            if i == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.sent.append(0)
                out.append(CallDelta(i, self.call_ids[i], name, ""))
            if len(arguments) > self.sent[i]:
                out.append(CallDelta(i, None, None, arguments[self.sent[i] :]))
                self.sent[i] = len(arguments)
        return out

    def finish(self) -> ParsedOutput:
        """The rest: content not yet released, and the tool calls (as ``parse`` would; those
        already streamed keep their ids)."""
        parsed = self.parser.parse(self.text)
        if not parsed.tool_calls and self.parser.rewrites_content:
            return ParsedOutput((parsed.content or "")[self.emitted :] or None)
        if not parsed.tool_calls:  # content, unless the whole reply has none (as parse says)
            rest = self.text[self.emitted :] if parsed.content is not None else ""
            return ParsedOutput(rest or None)
        calls = [
            ToolCall(self.call_ids[i], call.name, call.arguments)
            if i < len(self.call_ids)
            else call
            for i, call in enumerate(parsed.tool_calls)
        ]
        return ParsedOutput(None, calls)

    def remaining(self, calls: list[ToolCall]) -> list[CallDelta]:
        """``finish``'s calls as the deltas not streamed yet: a call not begun, its id and
        name then its arguments; one begun, the rest of its arguments."""
        out: list[CallDelta] = []
        for i, call in enumerate(calls):
            sent = self.sent[i] if i < len(self.sent) else None
            if sent is None:
                out += [CallDelta(i, call.id, call.name, ""), CallDelta(i, None, None, call.arguments)]  # fmt: skip
            elif len(call.arguments) > sent:
                out.append(CallDelta(i, None, None, call.arguments[sent:]))
        return out


@dataclass(slots=True, frozen=True)
class CallDelta:
    """A piece of a streamed call: its start (``id`` and ``name``), or more ``arguments``."""

    index: int
    id: str | None
    name: str | None
    arguments: str


# Used to probe a template: a conversation with one assistant tool call and its result.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
PROBE_CALL_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "probe question"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_probe0001",
                "type": "function",
                "function": {"name": "probe_tool", "arguments": {"q": "probe"}},
            }
        ],
    },
]
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def valid_function_name(name: str) -> bool:
    return bool(_NAME.match(name))
