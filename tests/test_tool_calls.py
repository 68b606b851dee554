"""Tool-call parsing: each format whole and streamed (any chunking gives the whole result),
valid and malformed (plain content, never an error); and the official ``openai`` client's
``tools=`` calls and stream accumulation over a scripted engine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from conftest import ServerLoop, serve
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_fake_engine import FakeTokenizer, ScriptedEngine

from prefixcache.sidecar.chat.tool_calls import (
    ForcedParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallParser,
    ToolCallStream,
)
from prefixcache.sidecar.server.app import SidecarSettings, create_app

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
SECOND = {"name": "search", "arguments": {"q": "café"}}

# (parser, output, expected content, expected [(name, arguments)])
VALID = [
    (HermesParser(), f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", None, [CALL]),
    (
        HermesParser(),
        f"Let me check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>{json.dumps(SECOND)}</tool_call>",
        "Let me check.\n",
        [CALL, SECOND],
    ),
    (HermesParser(), f"<tool_call>{json.dumps(CALL)}", None, [CALL]),  # EOS before the close tag
    (
        Llama3JsonParser(),
        json.dumps({"name": "get_weather", "parameters": CALL["arguments"]}),
        None,
        [CALL],
    ),
    (
        Llama3JsonParser(),
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": CALL["arguments"]})
        + "; "
        + json.dumps({"name": "search", "parameters": SECOND["arguments"]}),
        None,
        [CALL, SECOND],
    ),
    (MistralParser(), "[TOOL_CALLS]" + json.dumps([CALL, SECOND]), None, [CALL, SECOND]),
    (
        MistralParser(),
        "Sure. [TOOL_CALLS]get_weather[ARGS]" + json.dumps(CALL["arguments"]),
        "Sure. ",
        [CALL],
    ),
    (ForcedParser("get_weather"), json.dumps(CALL["arguments"]), None, [CALL]),
    (
        ForcedParser(None),
        json.dumps([{"name": c["name"], "parameters": c["arguments"]} for c in (CALL, SECOND)]),
        None,
        [CALL, SECOND],
    ),
]

MALFORMED = [
    (HermesParser(), "Plain answer, no tools."),
    (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    (HermesParser(), '<tool_call>["not", "an", "object"]</tool_call>'),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (HermesParser(), "<tool_call"),  # a marker cut short
    (Llama3JsonParser(), "The weather is fine."),
    (Llama3JsonParser(), '{"name": "f", "parameters": {"a": 1}} and then some words'),
    (Llama3JsonParser(), '{"name": "f", "parameters": [1]}'),
    (Llama3JsonParser(), "<|python_ta"),
    (MistralParser(), "[TOOL_CALLS][{broken"),
    (MistralParser(), "[TOOL_CALLS]just words"),
]

# Forced output max_tokens cut: still calls (the grammar allows nothing else), the last one's
# arguments as far as they came; never the forcing JSON as content.
CUT = [
    (ForcedParser("f"), '{"a": ', [("f", '{"a":')]),
    (ForcedParser(None), '[{"name": "f", "parameters": {"a": [1, ', [("f", '{"a": [1,')]),
    (
        ForcedParser(None),
        '[{"name":"f","parameters":{"a":1}},{"name":"g"',
        [("f", '{"a": 1}'), ("g", "")],
    ),
    (
        ForcedParser(None),
        '[{"name":"f","parameters":{}}, {"name": "g", "parameters": {"b',
        [("f", "{}"), ("g", '{"b')],
    ),
    (ForcedParser(None), '[{"name": "long_na', []),  # the name itself cut: no call to name
    # what the grammar never writes ends the calls there, never an error
    (ForcedParser(None), '[{"name":"f","parameters":{}},{"x":1},', [("f", "{}")]),
    (ForcedParser(None), '[{"name":"f","parameters":[1]}', []),
]


def calls_of(parsed: object) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in parsed.tool_calls]  # type: ignore[attr-defined]


def streamed(parser: ToolCallParser, text: str, cuts: list[int]) -> tuple[str | None, list[dict]]:
    stream = ToolCallStream(parser)
    content = ""
    last = 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]:
        content += stream.push(text[last:cut])
        last = cut
    rest = stream.finish()
    content += rest.content or ""
    return content or None, calls_of(rest)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), VALID)
def test_valid_calls_parse(
    parser: ToolCallParser, text: str, content: str | None, calls: list
) -> None:
    parsed = parser.parse(text)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_output_is_plain_content(parser: ToolCallParser, text: str) -> None:
    parsed = parser.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize(("parser", "text", "content", "calls"), VALID)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@settings(max_examples=40, deadline=None)
def test_streamed_valid_calls_equal_the_whole(
    parser: ToolCallParser, text: str, content: str | None, calls: list, cuts: list[int]
) -> None:
    assert streamed(parser, text, cuts) == (content, calls)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@settings(max_examples=40, deadline=None)
def test_streamed_malformed_output_is_all_content(
    parser: ToolCallParser, text: str, cuts: list[int]
) -> None:
    assert streamed(parser, text, cuts) == (text, [])


@pytest.mark.parametrize(("parser", "text", "calls"), CUT)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@settings(max_examples=20, deadline=None)
def test_cut_forced_output_is_the_calls_so_far(
    parser: ToolCallParser, text: str, calls: list[tuple[str, str]], cuts: list[int]
) -> None:
    parsed = parser.parse(text)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    stream = ToolCallStream(parser)
    last = 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]:
        assert stream.push(text[last:cut]) == ""
        last = cut
    rest = stream.finish()
    assert rest.content is None and [(c.name, c.arguments) for c in rest.tool_calls] == calls


def test_content_streams_before_a_call_begins() -> None:
    stream = ToolCallStream(HermesParser())
    assert stream.push("Checking the weather ") == "Checking the weather "
    assert stream.push("<tool") == ""  # could be the marker: held back
    assert stream.push("_call>{") == ""
    assert stream.push('"name": "f", "arguments": {}}</tool_call>') == ""
    rest = stream.finish()
    assert rest.content is None and [c.name for c in rest.tool_calls] == ["f"]


# --- the openai client against the sidecar, over an engine that says what it is told -------

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


class ToolTokenizer(FakeTokenizer):
    """Renders tools (so the sidecar accepts them) in a Hermes-like way."""

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: object
    ) -> str:
        tools = extra.get("tools")
        head = f"<tools>{json.dumps(tools)}</tools>\n" if tools else ""
        body = "".join(
            f"<{m['role']}>{m['content']}"
            + "".join(
                f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                for c in m.get("tool_calls", [])
            )
            + f"</{m['role']}>\n"
            for m in messages
        )
        return head + body + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def scripted(server_loop: ServerLoop) -> Iterator[tuple[ScriptedEngine, openai.OpenAI]]:
    engine = ScriptedEngine(ToolTokenizer())
    server_loop.run(engine.start())
    server = serve(server_loop, create_app(engine, SidecarSettings(manage_engine=False)))
    yield engine, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    server.stop()


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
TWO_CALLS = (
    'One moment. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>'
)


def test_openai_client_gets_tool_calls(scripted: tuple[ScriptedEngine, openai.OpenAI]) -> None:
    engine, client = scripted
    engine.script = TWO_CALLS
    reply = client.chat.completions.create(model="fake", messages=QUESTION, tools=[TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "One moment. "
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_weather", {"city": "Lyon"}),
    ]
    assert calls[0].id != calls[1].id
    # The result goes back in the history; the template sees the call and the tool turn.
    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C"},
    ]
    engine.script = "It is 21 C in Paris."
    follow = client.chat.completions.create(model="fake", messages=history, tools=[TOOL])
    assert follow.choices[0].finish_reason == "stop"
    assert follow.choices[0].message.content == "It is 21 C in Paris."
    assert follow.choices[0].message.tool_calls is None
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    )
    assert "<tool>21 C</tool>" in prompt


def test_openai_stream_accumulates_tool_calls(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    engine, client = scripted
    engine.script = TWO_CALLS
    with client.chat.completions.stream(model="fake", messages=QUESTION, tools=[TOOL]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "One moment. "
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    # The raw chunks: OpenAI's shape (index, id, type and name first, then the arguments).
    chunks = list(
        client.chat.completions.create(model="fake", messages=QUESTION, tools=[TOOL], stream=True)
    )
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0, 0, 1, 1]
    assert (
        deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    )
    assert deltas[1].id is None and json.loads(deltas[1].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """OpenAI promises at most one call with parallel_tool_calls false (vLLM keeps the first):
    under auto the model's output may hold two; the reply has the first, streamed or not, on
    chat and on the Responses API."""
    engine, client = scripted
    engine.script = TWO_CALLS
    fields = {"model": "fake", "messages": QUESTION, "tools": [TOOL], "parallel_tool_calls": False}
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "One moment. "
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [
        {"city": "Paris"}
    ]
    chunks = list(client.chat.completions.create(**fields, stream=True))
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()]
    assert {d.index for d in deltas} == {0}
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    tool = {"type": "function", **TOOL["function"]}
    reply = client.responses.create(
        model="fake", input="Weather in Paris?", tools=[tool], parallel_tool_calls=False
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}]
    both = client.chat.completions.create(**{**fields, "parallel_tool_calls": True})
    assert len(both.choices[0].message.tool_calls) == 2


def test_malformed_calls_reach_the_client_as_content(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    engine, client = scripted
    engine.script = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    reply = client.chat.completions.create(model="fake", messages=QUESTION, tools=[TOOL])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == engine.script
    assert reply.choices[0].message.tool_calls is None
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="fake", messages=QUESTION, tools=[TOOL], stream=True
        )
        if c.choices
    )
    assert text == engine.script


def test_tool_choice_none_leaves_the_text_alone(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    engine, client = scripted
    engine.script = TWO_CALLS
    reply = client.chat.completions.create(
        model="fake", messages=QUESTION, tools=[TOOL], tool_choice="none"
    )
    assert reply.choices[0].message.content == TWO_CALLS
    assert reply.choices[0].finish_reason == "stop"
