"""Tools and structured output end to end on the demo model (a Llama-3.1-style tools template
installed on its tokenizer), with the official ``openai`` client: forced tool calls are valid
against their schemas, json_schema replies validate, and step 2 of an agent loop finds the
tools block and the first step's transcript in the prefix cache."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from conftest import ServerLoop, demo_engine, health_gaps_while, serve
from tool_templates import LLAMA31_STYLE

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.serving.process_engine import ProcessEngine
from prefixcache.engine.text.tokenizer import compile_template
from prefixcache.sidecar.server.app import SidecarSettings, create_app

pytest.importorskip("llguidance")

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a document up by key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"enum": ["eviction", "pinning", "blocks"]}},
            "required": ["key"],
        },
    },
}
COUNT = {
    "type": "function",
    "function": {
        "name": "count",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
                "ok": {"type": "boolean"},
            },
            "required": ["n", "ok"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (LOOKUP, COUNT)}
START = [
    {"role": "system", "content": "You are an agent. Use the tools, then answer briefly. " * 4},
    {"role": "user", "content": "What is evicted first, and how many blocks are pinned?"},
]


@pytest.fixture(scope="module", params=["thread", "process"])
def client(
    request: pytest.FixtureRequest,
    server_loop: ServerLoop,
    demo_loaded: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[openai.OpenAI]:
    """The demo model with a tools template: on the engine thread (its tokenizer swapped in
    memory), and in the default process mode (a copy of its folder with chat_template.jinja:
    the core loads it, the grammar is compiled there, the API side renders with its tokenizer)."""
    if request.param == "process":
        folder = tmp_path_factory.mktemp("tools") / "demo"
        shutil.copytree(demo_loaded.path, folder)
        (folder / "chat_template.jinja").write_text(LLAMA31_STYLE, encoding="utf-8")
        config = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_blocks=256)
        engine: Any = ProcessEngine(config)
    else:
        tokenizer = copy.copy(demo_loaded.tokenizer)
        tokenizer.chat_template = LLAMA31_STYLE
        tokenizer._template = compile_template(LLAMA31_STYLE)
        engine = demo_engine(dataclasses.replace(demo_loaded, tokenizer=tokenizer))
    server = serve(server_loop, create_app(engine, SidecarSettings(model_aliases=("demo",))))
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_forced_tool_calls_are_valid_and_step_two_is_cached(client: openai.OpenAI) -> None:
    messages: list[dict] = list(START)
    first = client.chat.completions.create(
        model="demo",
        messages=messages,
        tools=[LOOKUP, COUNT],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a random model would go on listing calls
        max_tokens=64,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": "Least recently used leaves."}
        )
    second = client.chat.completions.create(
        model="demo",
        messages=messages,
        tools=[LOOKUP, COUNT],
        tool_choice={"type": "function", "function": {"name": "count"}},
        max_tokens=48,
    )
    # Step 2 starts with step 1's whole prompt (tools block and transcript): all of it cached
    # but the last token, which is always computed.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    named = second.choices[0]
    assert named.finish_reason == "stop"  # a named choice's call, as OpenAI (required's: above)
    (call,) = named.message.tool_calls
    assert call.function.name == "count"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["count"])
    streamed = client.chat.completions.create(
        model="demo",
        messages=messages,
        tools=[LOOKUP, COUNT],
        tool_choice={"type": "function", "function": {"name": "count"}},
        max_tokens=48,
        stream=True,
    )
    finishes = [c.choices[0].finish_reason for c in streamed if c.choices]
    assert [f for f in finishes if f] == ["stop"]  # streamed alike, once


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(
    client: openai.OpenAI, stream: bool
) -> None:
    """Not the forcing JSON as content: the call, its arguments as far as they came."""
    for choice in ("required", {"type": "function", "function": {"name": "count"}}):
        kw: dict[str, Any] = dict(
            model="demo", messages=START, tools=[LOOKUP, COUNT], tool_choice=choice, max_tokens=12
        )
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            assert chunks[0].choices[0].delta.content is None  # a forced call: no content at all
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
            names = [d.function.name for d in deltas if d.function and d.function.name]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            reply = client.chat.completions.create(**kw).choices[0]
            content, finish = reply.message.content or "", reply.finish_reason
            names = [call.function.name for call in reply.message.tool_calls or ()]
        assert finish == "length" and content == ""
        assert names and set(names) <= {"lookup", "count"}, names


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_a_stop_string_says_stop(client: openai.OpenAI, stream: bool) -> None:
    """A stop string inside the forced JSON: finish_reason "stop" with the call as far as it
    came (was "tool_calls" with arguments "{", or no call at all for "required")."""
    cases = [
        ({"type": "function", "function": {"name": "count"}}, '"ok"', [COUNT]),  # in its args
        ("required", '"parameters"', [LOOKUP, COUNT]),  # right after the name
    ]
    for choice, stop, tools in cases:
        kw: dict[str, Any] = dict(
            model="demo", messages=START, tools=tools, tool_choice=choice, max_tokens=48, stop=stop
        )
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
            names = [d.function.name for d in deltas if d.function and d.function.name]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            reply = client.chat.completions.create(**kw).choices[0]
            finish = reply.finish_reason
            names = [call.function.name for call in reply.message.tool_calls or ()]
            assert not reply.message.content
        assert finish == "stop", (choice, finish)
        assert len(names) == 1 and names[0] in {"lookup", "count"}, names


def test_json_schema_replies_validate(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {  # not in sorted order: the output keeps the schema's order
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
            "answer": {"enum": ["yes", "no"]},
        },
        "required": ["score", "answer"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    for stream in (False, True):
        if stream:
            chunks = client.chat.completions.create(
                model="demo", messages=START, response_format=fmt, max_tokens=48, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(
                model="demo", messages=START, response_format=fmt, max_tokens=48
            )
            assert reply.choices[0].finish_reason == "stop"
            text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert list(json.loads(text)) == ["score", "answer"]
    reply = client.chat.completions.create(
        model="demo",
        messages=START,
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_engine_cannot_use_is_a_400(
    client: openai.OpenAI, stream: bool
) -> None:
    """Streamed too: a 400 naming the field before any stream begins, not an error inside."""
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/missing"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="demo", messages=START, response_format=fmt, max_tokens=8, stream=stream
        )
    assert "schema" in str(refused.value)
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
    bad = copy.deepcopy(COUNT)
    bad["function"]["parameters"]["properties"]["n"]["type"] = "integr"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="demo",
            messages=START,
            tools=[LOOKUP, bad],
            tool_choice={"type": "function", "function": {"name": "count"}},
            max_tokens=8,
            stream=stream,
        )
    assert refused.value.body["param"] == "tools[1].function.parameters"  # type: ignore[index]


def test_a_schema_compiles_off_the_event_loop_once_per_namespace(
    client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big schema takes llguidance up to a second: the front end compiles it on a worker
    thread (the event loop answers /health meanwhile), keeps a refusal so that the same body
    sent again is refused at once, and keeps both per cache namespace (another salt compiles
    again: no tenant learns by timing what schemas another sent)."""
    from prefixcache.sidecar.server import generation

    calls: list[str] = []

    def slow_refusal(spec: Any) -> str:
        calls.append(spec.text)
        time.sleep(1.5)  # blocks whatever thread runs it
        raise ValueError("the JSON schema cannot be used for constrained output: slow")

    monkeypatch.setattr(generation, "compiled_grammar", slow_refusal)
    schema = {"type": "object", "properties": {"slow": {"type": "string"}}, "x-nonce": time.time()}
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}

    def ask(salt: str) -> None:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="demo",
                messages=START,
                response_format=fmt,
                max_tokens=4,
                extra_body={"cache_salt": salt},
            )

    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    gaps = health_gaps_while(root, lambda: ask("a"))
    assert len(calls) == 1 and len(gaps) >= 5
    assert max(gaps) < 0.75, gaps  # the 1.5 s compile never held the loop
    start = time.perf_counter()
    ask("a")  # the same schema, same namespace: refused from the cache
    assert len(calls) == 1 and time.perf_counter() - start < 1.5
    ask("b")  # another namespace: compiled again
    assert len(calls) == 2
