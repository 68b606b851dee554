"""Per-message rendering: a segment's tokens never depend on what follows it."""

from __future__ import annotations

import pytest
from sidecar_fake_engine import FakeTokenizer

from prefixcache.sidecar.chat.rendering import PromptRenderer, TemplateError, order_segments
from prefixcache.sidecar.wire.protocol import Message, Segment


def seg(tag: str, stability: str, content: str = "x", role: str = "user") -> Segment:
    return Segment(role=role, content=content, tag=tag, stability=stability)  # type: ignore[arg-type]


def test_segments_are_ordered_by_stability_and_stable_within_a_class() -> None:
    segments = [
        seg("d", "dynamic"),
        seg("s1", "session"),
        seg("a", "static"),
        seg("s2", "session"),
        seg("b", "shared"),
    ]
    assert [s.tag for s in order_segments(segments)] == ["a", "b", "s1", "s2", "d"]


def test_spans_cover_each_segment_and_the_generation_prompt_is_last() -> None:
    tokenizer = FakeTokenizer()
    renderer = PromptRenderer(tokenizer)
    segments = [seg("q", "dynamic", "why?"), seg("sys", "static", "rules", role="system")]
    prompt = renderer.render_chat(None, segments)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "rules"}, {"role": "user", "content": "why?"}]
    )
    assert prompt.token_ids == tokenizer.encode(text)
    (sys_span, q_span) = prompt.spans
    assert (sys_span.tag, sys_span.start) == ("sys", 0)
    assert q_span.start == sys_span.end and q_span.end < len(prompt.token_ids)
    assert tokenizer.decode(prompt.token_ids[q_span.end :]) == "<assistant>"


def test_a_prefix_renders_to_the_same_tokens_whatever_follows(demo_loaded) -> None:
    renderer = PromptRenderer(demo_loaded.tokenizer)
    system = Message(role="system", content="Policy: refunds within 7 days. " * 5)
    alone = renderer.render_messages(
        [{"role": "system", "content": system.text}], add_generation_prompt=False
    )
    for question in ("Hi", "What about refunds, exactly?", "¿Qué tal?"):
        full = renderer.render_chat([system, Message(role="user", content=question)], None)
        assert full.token_ids[: len(alone.token_ids)] == alone.token_ids
    # what /v1/cache/warm caches of these segments and a dynamic question (protocol.stable_chat)
    stable = renderer.render_chat(None, [seg("p", "static", system.text, "system")], False)
    assert stable.token_ids == alone.token_ids


class NonIncremental(FakeTokenizer):
    """Ends with a footer that depends on the number of messages."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + f"<{len(messages)} messages>"


def test_messages_render_whole_so_re_rendering_templates_work_but_segments_are_refused() -> None:
    tokenizer = NonIncremental()
    renderer = PromptRenderer(tokenizer)
    messages = [Message(role="system", content="S"), Message(role="user", content="U")]
    prompt = renderer.render_chat(messages, None)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    )
    assert prompt.token_ids == tokenizer.encode(text) and prompt.spans == []
    with pytest.raises(TemplateError, match="does not render segments incrementally"):
        renderer.render_chat(None, [seg("s", "static", "S", "system"), seg("u", "dynamic", "U")])


def test_text_parts_join_with_newlines_as_vllm_joins_them() -> None:
    """A message's text parts reach the template as one string, joined by newlines (vLLM's
    "string" content format), so their ids equal vLLM's."""
    from prefixcache.sidecar.wire.prompt_parts import Message, TextPart

    message = Message("user", [TextPart("text", "Be brief."), TextPart("text", "Really.")])
    assert message.text == "Be brief.\nReally."
