"""Tools on a chat template that does not render them (generic_tools.py): the messages
rewritten into the JSON format, the reply's grammar, the envelope parsed whole and streamed
under any chunking, and the official ``openai`` client's calls over a scripted engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import ServerLoop, demo_engine, serve
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_fake_engine import ScriptedEngine

from prefixcache.engine.grammar import compiled_grammar
from prefixcache.engine.request import GrammarSpec
from prefixcache.sdk.canonical import canonical_json
from prefixcache.sidecar.chat.generic_tools import (
    GenericParser,
    GenericTools,
    SchemaDefs,
    envelope_schema,
)
from prefixcache.sidecar.chat.tool_calls import ToolCallStream
from prefixcache.sidecar.server.app import SidecarSettings, create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = GenericTools([json.loads(canonical_json(WEATHER))])  # as the server canonicalises
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}


def test_the_tools_join_the_system_message_or_make_one() -> None:
    text = TOOLS.system_text()
    assert json.dumps(TOOLS.tools[0]["function"], separators=(", ", ": ")) in text
    user = {"role": "user", "content": "hi"}
    assert TOOLS.messages([user]) == [{"role": "system", "content": text}, user]
    system = {"role": "system", "content": "Be brief."}
    assert TOOLS.messages([system, user]) == [
        {"role": "system", "content": f"Be brief.\n\n{text}"},
        user,
    ]


def test_history_is_written_as_the_reply_format() -> None:
    """Past calls and answers as the envelope the model writes; a run of tool results and the
    user turn after them one user turn (templates that alternate roles), or, for segments
    (merge off), one turn each."""
    history = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "19 C"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You're welcome."},
    ]
    out = TOOLS.messages(history)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert json.loads(out[2]["content"]) == {"tool_calls": [call, call]}
    results = out[3]["content"].split("\n\n")
    assert [json.loads(r) for r in results[:2]] == [
        {"tool_response": {"name": "get_weather", "content": "21 C"}},
        {"tool_response": {"name": "get_weather", "content": "19 C"}},
    ]
    assert results[2] == "Thanks."
    assert out[4]["content"] == '{"response":"You\'re welcome."}'  # compact, as generated
    unmerged = TOOLS.messages(history, merge=False)
    assert [m["role"] for m in unmerged] == ["system", "user", "assistant", "user", "user", "user", "assistant"]  # fmt: skip
    # The arguments as the client sent them back (the reply's own text) are kept as they are.
    sent = [None, ['{"city":"Lyon"}', '{"city":  "Paris"}'], None, None, None, None]
    again = TOOLS.messages(history, arguments=sent)
    assert again[2]["content"] == (
        '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Lyon"}},'
        '{"name":"get_weather","arguments":{"city":  "Paris"}}]}'
    )


def test_a_tool_result_is_named_by_the_latest_call_with_its_id() -> None:
    """Clients that number their calls per turn reuse ids: each result belongs to the call
    of the latest assistant turn that made one with its id."""
    time_call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}  # fmt: skip
    history = [
        {"role": "user", "content": "Weather, then time?"},
        {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
        {"role": "assistant", "content": "", "tool_calls": [time_call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    out = TOOLS.messages(history)
    assert json.loads(out[3]["content"])["tool_response"]["name"] == "get_weather"
    assert json.loads(out[5]["content"])["tool_response"]["name"] == "get_time"


def test_arguments_holding_a_lone_surrogate_still_render() -> None:
    """``"\\ud800"`` in a call's arguments reads as a lone surrogate, which no tokenizer
    takes: the history keeps it escaped rather than failing the request."""
    call = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "\ud800"}}}
    out = TOOLS.messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    out[1]["content"].encode()  # valid UTF-8
    assert "\\ud800" in out[1]["content"]


def test_the_envelope_lifts_each_schemas_definitions_to_its_root() -> None:
    """pydantic's schemas refer to ``#/$defs/...``: nested in the envelope, their definitions
    must sit at its root; two different definitions of one name are refused (vLLM's rule)."""
    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    params = {"type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}  # fmt: skip
    schema = envelope_schema(
        [("f", params)], False, {"$ref": "#/$defs/City", "$defs": {"City": city}}
    )
    assert schema["$defs"] == {"City": city}
    assert '"$defs":' not in json.dumps(schema["anyOf"])
    compiled_grammar(GrammarSpec("json_schema", json.dumps(schema)))  # its references resolve
    other = {**params, "$defs": {"City": {"type": "string"}}}
    with pytest.raises(ValueError, match="City"):
        envelope_schema([("f", params), ("g", other)], False, {"type": "string"})
    defs = SchemaDefs()
    assert defs.lift({"type": "string"}, "#") == {"type": "string"} and defs.into({}) == {}
    # Other local references point where the schema now lies (OpenAI's tools may use them).
    local = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}  # fmt: skip
    nested = envelope_schema([("f", local)], False, {"type": "string"})
    arguments = nested["anyOf"][0]["properties"]["tool_calls"]["items"]["anyOf"][0]["properties"]["arguments"]  # fmt: skip
    assert arguments["properties"]["b"]["$ref"] == "#/anyOf/0/properties/tool_calls/items/anyOf/0/properties/arguments/properties/a"  # fmt: skip
    compiled_grammar(GrammarSpec("json_schema", json.dumps(nested)))


PARSED = [
    (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    ('{"response": "It is \\"sunny\\" \\ud83d\\ude00"}', 'It is "sunny" \U0001f600', []),
    ('{"response": "cut by max_tok', "cut by max_tok", []),
    (
        '{"tool_calls":[{"name":"a","arguments":{}},{"name":"b","argu',
        None,
        [("a", {}), ("b", None)],
    ),
    ('{"response": ""}', None, []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PARSED)
def test_envelopes_parse(text: str, content: str | None, calls: list) -> None:
    parsed = GenericParser().parse(text)
    assert parsed.content == content
    got = [(c.name, json.loads(c.arguments) if c.arguments else None) for c in parsed.tool_calls]
    assert got == calls


def chunked(parser: GenericParser, text: str, cuts: list[int]) -> tuple[str, list[str]]:
    stream = ToolCallStream(parser)
    seen, last, content = [], 0, ""
    for cut in sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]:
        content += stream.push(text[last:cut])
        seen.append(content)
        last = cut
    rest = stream.finish()
    assert not rest.tool_calls
    return content + (rest.content or ""), seen


@settings(max_examples=300, deadline=None)
@given(
    st.text(),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    st.sampled_from(["", " ", "\n  "]),
)
def test_a_streamed_response_is_its_text_under_any_chunking(
    answer: str, ascii_only: bool, cuts: list[int], space: str
) -> None:
    """Escapes, surrogate pairs and quotes split anywhere: what streams is always a prefix of
    the answer, and the stream ends with exactly the answer."""
    value = json.dumps(answer, ensure_ascii=ascii_only)
    text = "{" + space + '"response":' + space + value + space + "}"
    whole, seen = chunked(GenericParser(), text, cuts)
    assert whole == answer or (whole == "" and not answer.strip())
    assert all(answer.startswith(s) for s in seen)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_a_structured_response_streams_its_json_text(value: dict, cuts: list[int]) -> None:
    """With a response_format, the content is the response value's JSON text as generated."""
    raw = json.dumps(value)
    text = '{"response": ' + raw + "}"
    whole, seen = chunked(GenericParser(structured=True), text, cuts)
    assert whole == raw
    assert all(raw.startswith(s) for s in seen)


@pytest.fixture(scope="module")
def scripted(server_loop: ServerLoop) -> Iterator[tuple[ScriptedEngine, openai.OpenAI]]:
    engine = ScriptedEngine()
    server_loop.run(engine.start())
    server = serve(server_loop, create_app(engine, SidecarSettings(manage_engine=False)))
    yield engine, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    server.stop()


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
ENVELOPE_CALL = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'  # compact


def test_openai_client_calls_tools_through_the_generic_format(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    engine, client = scripted
    engine.script = ENVELOPE_CALL
    reply = client.chat.completions.create(model="fake", messages=QUESTION, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})  # fmt: skip
    request = engine.received[-1]
    prompt = engine.tokenizer.decode(request.prompt_token_ids)
    assert prompt.startswith(f"<system>{TOOLS.system_text()}</system>")
    grammar = json.loads(request.sampling.grammar.text)
    assert [list(o["properties"]) for o in grammar["anyOf"]] == [["tool_calls"], ["response"]]
    # The result goes back; the next prompt starts with this one's and the call as generated.
    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"},
    ]
    engine.script = '{"response": "It is 21 C."}'
    follow = client.chat.completions.create(model="fake", messages=history, tools=[WEATHER])
    assert follow.choices[0].message.content == "It is 21 C."
    assert follow.choices[0].finish_reason == "stop"
    assert follow.choices[0].message.tool_calls is None
    after = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert after.startswith(prompt[: -len("<assistant>")])
    assert f"<assistant>{ENVELOPE_CALL}</assistant>" in after


def test_a_streamed_answer_arrives_as_text(scripted: tuple[ScriptedEngine, openai.OpenAI]) -> None:
    engine, client = scripted
    engine.script = '{"response": "Sunny, \\"21\\" C"}'
    stream = client.chat.completions.create(
        model="fake", messages=QUESTION, tools=[WEATHER], stream=True
    )
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]  # fmt: skip
    assert "".join(deltas) == 'Sunny, "21" C' and len(deltas) > 1


def test_a_response_format_is_the_answers_json(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """With a response_format the answer is a JSON value of its schema (the Agents SDK's
    output_type with tools), given as generated; the call stays possible."""
    engine, client = scripted
    engine.script = '{"response": {"answer": "sunny"}}'
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    reply = client.chat.completions.create(
        model="fake", messages=QUESTION, tools=[WEATHER], response_format=fmt
    )
    assert reply.choices[0].message.content == '{"answer": "sunny"}'
    grammar = json.loads(engine.received[-1].sampling.grammar.text)
    assert grammar["anyOf"][1]["properties"] == {"response": {"type": "object"}}
    assert "tool_calls" in grammar["anyOf"][0]["properties"]


def test_tool_choice_none_is_the_plain_prompt(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """No call wanted: the prompt without the tools and the model's own text (LangChain and
    llama-index send tools bound with "none")."""
    engine, client = scripted
    engine.script = "Sunny."
    reply = client.chat.completions.create(
        model="fake", messages=QUESTION, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.content == "Sunny."
    request = engine.received[-1]
    assert request.sampling.grammar is None
    assert (
        engine.tokenizer.decode(request.prompt_token_ids)
        == "<user>Weather in Paris?</user>\n<assistant>"
    )


def test_required_and_named_calls_take_the_envelope_too(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """Every turn reads alike: a required call is the envelope's calls alone, a named one its
    one call of that function (finishing "stop", as OpenAI's named calls do); continuing a
    final message cannot start the format."""
    engine, client = scripted
    engine.script = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Lyon"}}]}'
    reply = client.chat.completions.create(
        model="fake", messages=QUESTION, tools=[WEATHER], tool_choice="required"
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"city": "Lyon"}
    request = engine.received[-1]
    assert TOOLS.system_text() in engine.tokenizer.decode(request.prompt_token_ids)
    assert list(json.loads(request.sampling.grammar.text)["properties"]) == ["tool_calls"]
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model="fake", messages=QUESTION, tools=[other, WEATHER], tool_choice=named
    )
    assert reply.choices[0].finish_reason == "stop"
    schema = json.loads(engine.received[-1].sampling.grammar.text)["properties"]["tool_calls"]
    assert schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "get_weather"}]
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model="fake",
            messages=[*QUESTION, {"role": "assistant", "content": "It"}],
            tools=[WEATHER],
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )


def test_warm_caches_the_prefix_chat_renders_with_generic_tools(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """/v1/cache/warm renders tools as chat does, so a warmed prefix is chat's."""
    engine, client = scripted
    body = {"messages": [{"role": "system", "content": "Be brief."}], "tools": [WEATHER]}
    warm = httpx.post(f"{client.base_url}cache/warm", json=body).json()
    engine.script = '{"response": "ok"}'
    client.chat.completions.create(
        model="fake", messages=[*body["messages"], *QUESTION], tools=[WEATHER]
    )
    prompt = engine.tokenizer.decode(engine.received[-1].prompt_token_ids)
    system = f"<system>Be brief.\n\n{TOOLS.system_text()}</system>\n"
    assert prompt.startswith(system) and len(system.encode()) == warm["tokens"]


@pytest.fixture(scope="module")
def demo(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[openai.OpenAI]:
    """The demo model: its template renders no tools."""
    server = serve(server_loop, create_app(demo_engine(demo_loaded), SidecarSettings()))
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lyon"]}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("question", ["Weather in Paris?", "Rain in Lyon, Nice or Brest?"])
def test_a_real_model_replies_in_the_format_streamed_alike(
    demo: openai.OpenAI, question: str
) -> None:
    """The demo model (random weights) under the envelope's grammar: calls valid against
    their schema or text, never the envelope itself; greedy, a stream gives the same reply;
    the call sent back, the next prompt finds this one's in the cache."""
    messages: list[dict] = [{"role": "user", "content": question}]
    body: dict[str, Any] = dict(model="demo", messages=messages, tools=[CITY], temperature=0)
    first = demo.chat.completions.create(**body, max_tokens=160, parallel_tool_calls=False)
    message = first.choices[0].message
    streamed = demo.chat.completions.create(
        **body, max_tokens=160, parallel_tool_calls=False, stream=True
    )
    text, calls = "", []
    for chunk in streamed:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
    assert (text or None) == message.content
    assert not (message.content or "").lstrip().startswith('{"response"')
    if message.tool_calls:
        (call,) = message.tool_calls
        assert [c.function.name for c in calls if c.function.name] == [call.function.name]
        if first.choices[0].finish_reason == "tool_calls":
            jsonschema.validate(json.loads(call.function.arguments), CITY["function"]["parameters"])
    if first.choices[0].finish_reason == "length" and message.tool_calls:
        return  # a call cut by max_tokens is no call to send back (a 400, as vLLM's)
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or ():
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "21 C"})
    messages.append({"role": "user", "content": "Thanks."})
    second = demo.chat.completions.create(**body, max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16  # whole blocks of the first prompt


def test_a_call_a_stop_string_cut_is_not_a_finished_call(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """The envelope cut inside a call's arguments (a stop string, max_tokens): the call as far
    as it came, and the finish says what cut it, never "tool_calls"."""
    engine, client = scripted
    engine.script = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"'
    reply = client.chat.completions.create(model="fake", messages=QUESTION, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls[0].function.arguments == '{"city":"'  # fmt: skip


def test_non_object_parameters_and_none_with_a_prefill(
    scripted: tuple[ScriptedEngine, openai.OpenAI],
) -> None:
    """Parameters that are no object schema are refused (as OpenAI); tool_choice "none" is the
    plain prompt, so a prefilled final message may be continued."""
    engine, client = scripted
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="fake", messages=QUESTION, tools=[bad])
    assert caught.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]
    engine.script = " sunny."
    reply = client.chat.completions.create(
        model="fake",
        messages=[*QUESTION, {"role": "assistant", "content": "It is"}],
        tools=[WEATHER],
        tool_choice="none",
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert reply.choices[0].message.content == " sunny."


def streamed_calls(parser: GenericParser, text: str, cuts: list[int]) -> tuple[dict, list]:
    """The calls a stream sends (id, name, arguments by index), pushed at ``cuts``, and the
    calls its finish gives."""
    stream = ToolCallStream(parser)
    sent: dict[int, list] = {}
    last = 0

    def take(deltas: list) -> None:
        for d in deltas:
            if d.id is not None:
                assert d.index == len(sent) and d.arguments == ""  # a call begins whole-named
                sent[d.index] = [d.id, d.name, ""]
            else:
                sent[d.index][2] += d.arguments

    for cut in sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]:
        stream.push(text[last:cut])
        take(stream.call_deltas())
        last = cut
    calls = stream.finish().tool_calls
    take(stream.remaining(calls))
    return sent, calls


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=16),
    st.booleans(),
)
def test_calls_stream_as_they_are_generated(arguments: list[dict], cuts: list[int], cut: bool) -> None:  # fmt: skip
    """Under any chunking the streamed pieces add up to the finished calls, ids included, and
    a call's arguments are sent as they come; cut short, the last call as far as it came."""
    items = [f'{{"name":"f{i}","arguments":{json.dumps(a, separators=(",", ":"))}}}' for i, a in enumerate(arguments)]  # fmt: skip
    text = '{"tool_calls":[' + ",".join(items) + "]}"
    if cut:
        text = text[: len(text) * 2 // 3]
    sent, calls = streamed_calls(GenericParser(), text, cuts)
    assert [tuple(sent[i]) for i in range(len(sent))] == [(c.id, c.name, c.arguments) for c in calls]  # fmt: skip
    if not cut:
        assert [json.loads(c.arguments) for c in calls] == arguments
