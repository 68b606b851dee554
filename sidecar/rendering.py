"""Messages and segments → prompt token ids with per-segment spans.

Each message is rendered through the model's chat template *incrementally*: message i's text is
``render(messages[:i+1]) - render(messages[:i])`` and is tokenized on its own, so its tokens
never depend on what follows. A long system message is therefore a token prefix of every
request that starts with it, whatever comes after. The generation prompt is its own last piece.

    render(m[:1])        |<- piece 0 ->|
    render(m[:2])        |<- piece 0 ->|<- piece 1 ->|
    render(m, gen=True)  |<- piece 0 ->|<- piece 1 ->|<- gen ->|
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from prefixcache.engine.request import SegmentSpan

from .protocol import STABILITY_ORDER, Message, Segment


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


class TemplateError(ValueError):
    """The chat template does not render messages incrementally (a prefix changed)."""


@dataclass(slots=True)
class RenderedPrompt:
    token_ids: list[int]
    spans: list[SegmentSpan]  # one per tagged segment, in prompt order; [] for plain messages


def order_segments(segments: list[Segment]) -> list[Segment]:
    """static → shared → session → dynamic, stable within a class."""
    return sorted(segments, key=lambda s: STABILITY_ORDER[s.stability])


class PromptRenderer:
    def __init__(self, tokenizer: ChatTokenizer, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        # Stable pieces (system prompts, documents) repeat across requests: tokenize them once.
        self._encode = lru_cache(maxsize=cache_size)(self._encode_uncached)

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def render_messages(
        self,
        messages: list[dict[str, str]],
        tags: list[str] | None = None,
        add_generation_prompt: bool = True,
    ) -> RenderedPrompt:
        """Tokenize ``messages`` piece by piece; ``tags[i]`` names message i's span."""
        template = self.tokenizer.apply_chat_template
        token_ids: list[int] = []
        spans: list[SegmentSpan] = []
        previous = ""
        for i in range(len(messages)):
            text = template(messages[: i + 1], add_generation_prompt=False)
            piece = _difference(previous, text, i)
            start = len(token_ids)
            token_ids.extend(self._encode(piece))
            if tags is not None:
                spans.append(SegmentSpan(tags[i], start, len(token_ids)))
            previous = text
        if add_generation_prompt:
            text = template(messages, add_generation_prompt=True)
            token_ids.extend(self._encode(_difference(previous, text, len(messages))))
        return RenderedPrompt(token_ids, spans)

    def render_chat(
        self, messages: list[Message] | None, segments: list[Segment] | None
    ) -> RenderedPrompt:
        """A chat request's prompt, ending with the generation prompt."""
        if segments is not None:
            ordered = order_segments(segments)
            return self.render_messages(
                [{"role": s.role, "content": s.content} for s in ordered],
                tags=[s.tag for s in ordered],
            )
        assert messages is not None
        return self.render_messages([{"role": m.role, "content": m.text} for m in messages])

    def render_stable(
        self, messages: list[Message] | None, segments: list[Segment] | None
    ) -> RenderedPrompt:
        """What /v1/cache/warm caches: no dynamic segments and no generation prompt."""
        if segments is not None:
            ordered = [s for s in order_segments(segments) if s.stability != "dynamic"]
            return self.render_messages(
                [{"role": s.role, "content": s.content} for s in ordered],
                tags=[s.tag for s in ordered],
                add_generation_prompt=False,
            )
        assert messages is not None
        return self.render_messages(
            [{"role": m.role, "content": m.text} for m in messages], add_generation_prompt=False
        )


def _difference(shorter: str, longer: str, index: int) -> str:
    if not longer.startswith(shorter):
        raise TemplateError(
            "the model's chat template does not render incrementally: adding message "
            f"{index} changed the text of the messages before it, so a shared prefix cannot "
            "be tokenized on its own"
        )
    return longer[len(shorter) :]
