"""Messages and segments → prompt token ids with per-segment spans.

Plain ``messages`` are rendered once through the chat template and the text is encoded once
without special tokens: exactly what transformers' ``apply_chat_template(tokenize=True)``
does, so the ids equal vLLM's.

Tagged ``segments`` are rendered *incrementally*: segment i's text is
``render(m[:i+1]) - render(m[:i])`` and is tokenized on its own, so its tokens never depend on
what follows (the segment contract). The generation prompt is its own last piece.

    render(m[:1])        |<- piece 0 ->|
    render(m[:2])        |<- piece 0 ->|<- piece 1 ->|
    render(m, gen=True)  |<- piece 0 ->|<- piece 1 ->|<- gen ->|

For templates whose pieces meet at special tokens (Llama-3, ChatML) both paths give the same
ids; for SentencePiece templates without them a piece boundary can tokenize differently.

Every encode is under the request's cache namespace: the memo of segment encodings here and
the tokenizer's own piece memo never let one tenant's timing depend on another's prompts. The
memo is bounded in bytes; ``forget`` drops what a refused request added.
"""

from __future__ import annotations

import json
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixcache.engine.request import RetentionHint, SegmentSpan
from prefixcache.engine.text.tokenizer import ChatTemplateError
from prefixcache.sdk.canonical import canonical_json

from ..wire.protocol import (
    MAX_OPENAI_BREAKPOINTS,
    Message,
    Segment,
    arguments_object,
    order_segments,
)
from .generic_tools import GenericTools


class ChatTokenizer(Protocol):
    def encode(
        self, text: str, add_special_tokens: bool = False, namespace: str = ""
    ) -> list[int]: ...
    def forget(self, text: str, namespace: str = "") -> None: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


class TemplateError(ValueError):
    """The chat template does not render segments incrementally (a prefix changed)."""


@dataclass(slots=True)
class RenderedPrompt:
    token_ids: list[int]
    spans: list[SegmentSpan]  # one per tagged segment, in prompt order; [] for plain messages
    namespace: str = ""
    texts: list[str] = field(default_factory=list)  # what was encoded, for ``forget``
    retain: list[RetentionHint] = field(default_factory=list)  # from cache_control marks


class EncodingMemo:
    """(namespace, text) -> ids, least recently used first out, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], array] = OrderedDict()
        self._fresh: set[tuple[str, str]] = set()  # stored, not hit since: what pop_fresh drops
        self._lock = threading.Lock()  # rendering runs on worker threads too

    def get(self, namespace: str, text: str) -> array | None:
        with self._lock:
            ids = self._entries.get((namespace, text))
            if ids is not None:
                self._entries.move_to_end((namespace, text))
                self._fresh.discard((namespace, text))
            return ids

    def put(self, namespace: str, text: str, ids: array) -> None:
        size = _entry_bytes(text, ids)
        if size > self.max_bytes // 4:
            return  # one huge piece would flush everything else
        with self._lock:
            if (namespace, text) in self._entries:
                return
            self._entries[(namespace, text)] = ids
            self._fresh.add((namespace, text))
            self.bytes += size
            while self.bytes > self.max_bytes:
                old, old_ids = self._entries.popitem(last=False)
                self._fresh.discard(old)
                self.bytes -= _entry_bytes(old[1], old_ids)

    def pop_fresh(self, namespace: str, text: str) -> None:
        """Drop the entry if no request hit it since it was stored (a refused one's own)."""
        with self._lock:
            if (namespace, text) in self._fresh:
                self._fresh.discard((namespace, text))
                self.bytes -= _entry_bytes(text, self._entries.pop((namespace, text)))

    def __len__(self) -> int:
        return len(self._entries)


def _entry_bytes(text: str, ids: array) -> int:
    return sys.getsizeof(text) + sys.getsizeof(ids) + 200  # + the key tuple and dict slot


class PromptRenderer:
    def __init__(self, tokenizer: ChatTokenizer, memo_bytes: int = 32 * 1024**2) -> None:
        self.tokenizer = tokenizer
        # Stable pieces (system prompts, documents) repeat across requests: tokenize them once.
        self.memo = EncodingMemo(memo_bytes)

    def _encode(self, text: str, namespace: str) -> array:
        ids = self.memo.get(namespace, text)
        if ids is None:
            ids = array(
                "l", self.tokenizer.encode(text, add_special_tokens=False, namespace=namespace)
            )
            self.memo.put(namespace, text, ids)
        return ids

    def forget(self, prompt: RenderedPrompt) -> None:
        """Keep nothing of a prompt whose request was refused (its texts and their pieces)."""
        for text in prompt.texts:
            self.memo.pop_fresh(prompt.namespace, text)
            self.tokenizer.forget(text, prompt.namespace)

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        namespace: str = "",
    ) -> RenderedPrompt:
        """The whole conversation rendered once and encoded once (transformers' way)."""
        final = messages[-1]["content"] if continue_final_message and messages else None
        if final is not None:  # mark where the last message ends, as transformers 5 does
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
        )
        if final is not None:
            text = _cut_at_continue_tag(text, final)
        ids = self.tokenizer.encode(text, add_special_tokens=False, namespace=namespace)
        return RenderedPrompt(ids, [], namespace, [text])

    def render_pieces(
        self,
        messages: list[dict[str, Any]],
        tags: list[str],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        namespace: str = "",
    ) -> RenderedPrompt:
        """Tokenize ``messages`` piece by piece; ``tags[i]`` names message i's span."""
        extra = template_kwargs or {}

        def template(part: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            return self.tokenizer.apply_chat_template(part, add_generation_prompt, **extra)

        token_ids: list[int] = []
        spans: list[SegmentSpan] = []
        pieces: list[str] = []
        previous = ""
        for i in range(len(messages)):
            text = template(messages[: i + 1], add_generation_prompt=False)
            pieces.append(_difference(previous, text, i))
            start = len(token_ids)
            token_ids.extend(self._encode(pieces[-1], namespace))
            spans.append(SegmentSpan(tags[i], start, len(token_ids)))
            previous = text
        if add_generation_prompt:
            text = template(messages, add_generation_prompt=True)
            pieces.append(_difference(previous, text, len(messages)))
            token_ids.extend(self._encode(pieces[-1], namespace))
        return RenderedPrompt(token_ids, spans, namespace, pieces)

    def render_chat(
        self,
        messages: list[Message] | None,
        segments: list[Segment] | None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        namespace: str = "",
        generic_tools: GenericTools | None = None,
    ) -> RenderedPrompt:
        """A chat request's prompt, by default ending with the generation prompt;
        ``generic_tools``: the tools of a template that does not render them, written into
        the messages (generic_tools.py)."""
        if segments is not None:
            ordered = order_segments(segments)
            tags = [s.tag for s in ordered]
            pieces = _dicts(ordered)
            if generic_tools is not None:
                pieces = generic_tools.messages(pieces, merge=False)
            added = len(pieces) - len(ordered)  # the tools' system message, untagged
            out = self.render_pieces(
                pieces, [""] * added + tags, add_generation_prompt, template_kwargs, namespace
            )
            out.spans = out.spans[added:]
            out.retain = [
                RetentionHint(span.end, s.cache_control.ttl_s)
                for s, span in zip(ordered, out.spans, strict=True)
                if s.cache_control is not None
            ]
            out.spans = [
                SegmentSpan(span.tag, span.start, span.end, s.reuse) if s.reuse else span
                for s, span in zip(ordered, out.spans, strict=True)
            ]
            return out
        assert messages is not None
        out = self.render_messages(
            _dicts(messages, generic_tools),
            add_generation_prompt,
            template_kwargs,
            continue_final_message,
            namespace,
        )
        out.retain = self._message_hints(
            messages, out.token_ids, template_kwargs, namespace, generic_tools
        )
        return out

    def with_special_tokens(self, out: RenderedPrompt) -> RenderedPrompt:
        """vLLM's ``add_special_tokens`` on a conversation: its rendered text encoded with the
        tokenizer's special tokens (its post-processor's, e.g. a BOS) on top of those the
        template wrote. The retention hints move with the rendered ids (dropped should the
        encoding not hold them whole)."""
        (text,) = out.texts  # plain messages: rendered once
        ids = self.tokenizer.encode(text, add_special_tokens=True, namespace=out.namespace)
        shift = _position_of(out.token_ids, ids)
        retain = (
            [] if shift is None else [RetentionHint(h.end + shift, h.ttl_s) for h in out.retain]
        )
        return RenderedPrompt(ids, out.spans, out.namespace, out.texts, retain)

    def _message_hints(
        self,
        messages: list[Message],
        token_ids: list[int],
        template_kwargs: dict[str, Any] | None,
        namespace: str,
        generic_tools: GenericTools | None = None,
    ) -> list[RetentionHint]:
        """A ``cache_control`` (Anthropic's) or ``prompt_cache_breakpoint`` (OpenAI's) on
        message i's content part j keeps the prompt up to the end of that part: the
        conversation cut there, rendered alone, and matched against the prompt (the tokens the
        two share). OpenAI's breakpoints accumulate over a conversation and are not refused
        past a count: the latest ``MAX_OPENAI_BREAKPOINTS`` of them are written."""
        marked = [
            (i, j, part.cache_control is None, ttl_s)
            for i, message in enumerate(messages)
            if isinstance(message.content, list)
            for j, part in enumerate(message.content)
            if (ttl_s := part.retention_s) is not None
        ]
        openai_only = [(i, j) for i, j, openai, _ in marked if openai]
        older = set(openai_only[:-MAX_OPENAI_BREAKPOINTS])
        hints: list[RetentionHint] = []
        for i, j, _, ttl_s in marked:
            if (i, j) in older:
                continue
            content = messages[i].content
            assert isinstance(content, list)
            cut = [*messages[:i], Message(messages[i].role, list(content[: j + 1]))]
            head = self.render_messages(
                _dicts(cut, generic_tools), False, template_kwargs, namespace=namespace
            ).token_ids
            hints.append(RetentionHint(common_prefix(head, token_ids), ttl_s))
        return hints


def _position_of(inner: list[int], outer: list[int]) -> int | None:
    """Where ``inner`` lies whole in ``outer`` (a few special tokens around it), or None."""
    for at in range(len(outer) - len(inner) + 1):
        if outer[at : at + len(inner)] == inner:
            return at
    return None


def _dicts(
    messages: list[Message] | list[Segment], generic_tools: GenericTools | None = None
) -> list[dict[str, Any]]:
    dicts = [_dict(m) for m in messages]
    if generic_tools is None:
        return dicts
    sent = [
        [c.function.arguments for c in m.tool_calls]
        if isinstance(m, Message) and m.tool_calls
        else None
        for m in messages
    ]
    return generic_tools.messages(dicts, arguments=sent)


def _dict(m: Message | Segment) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role  # OpenAI's alias
    if isinstance(m, Segment):
        return {"role": role, "content": m.content}
    out: dict[str, Any] = {"role": role, "content": m.text}
    if m.tool_calls:  # arguments as objects, keys sorted: what templates expect (as vLLM)
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": json.loads(
                        canonical_json(arguments_object(call.function.arguments))
                    ),
                },
            }
            for call in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers 5's marker, for identical text


def _cut_at_continue_tag(text: str, final: str) -> str:
    """The rendered text up to where the last message ends, so the model continues it.

    As transformers 5's ``continue_final_message``: the message was rendered with a marker
    appended; cut at the marker, and drop trailing spaces if the template trimmed the marker's.
    """
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat (the template changed it)"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _difference(shorter: str, longer: str, index: int) -> str:
    if not longer.startswith(shorter):
        raise TemplateError(
            "the model's chat template does not render segments incrementally: adding segment "
            f"{index} changed the text of the segments before it, so they cannot be tokenized "
            "on their own; send 'messages' instead"
        )
    return longer[len(shorter) :]
