"""The Responses API (issue 26) with the official ``openai`` client against a live sidecar on
the demo model (a tools template installed): plain, streamed, function tools, json_schema,
``previous_response_id`` (per tenant, bounded), cached tokens, and errors in OpenAI's shape."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from conftest import API_KEYS, Server

from prefixcache.sidecar.responses_api.store import ResponseStore
from prefixcache.sidecar.wire.protocol import Message

pytest.importorskip("llguidance")

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look a document up by key.",
    "parameters": {
        "type": "object",
        "properties": {"key": {"enum": ["eviction", "pinning", "blocks"]}},
        "required": ["key"],
    },
}
ANSWER = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tools_sidecar: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=tools_sidecar.url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def instructions() -> str:
    return f"Run {uuid.uuid4().hex}. You answer questions about caches, briefly. " * 10


def test_create_reports_cached_tokens(client: openai.OpenAI) -> None:
    rules = instructions()
    first = client.responses.create(
        model="demo", instructions=rules, input="What is evicted first?", max_output_tokens=5
    )
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text and first.output[0].type == "message"
    assert first.usage.output_tokens == 5
    assert first.usage.input_tokens_details.cached_tokens < 32  # only the template's head
    second = client.responses.create(
        model="demo", instructions=rules, input="And what is pinned?", max_output_tokens=5
    )
    assert second.usage.input_tokens_details.cached_tokens > 100
    assert second.model_extra["prefixcache"]["cached_tokens"] == (
        second.usage.input_tokens_details.cached_tokens
    )
    for usage in (first.usage, second.usage):  # the KV computed now, as chat's
        details = usage.input_tokens_details
        assert details.cache_write_tokens == usage.input_tokens - details.cached_tokens


def test_cache_salt_narrows_the_namespace(client: openai.OpenAI) -> None:
    """vLLM's cache_salt works here as on chat (it was ignored: another salt still hit)."""
    rules = instructions()
    body = dict(
        model="demo", instructions=rules, input="What is evicted first?", max_output_tokens=2
    )
    client.responses.create(**body, extra_body={"cache_salt": "alice"})
    again = client.responses.create(**body, extra_body={"cache_salt": "alice"})
    other = client.responses.create(**body, extra_body={"cache_salt": "bob"})
    assert again.usage.input_tokens_details.cached_tokens > 100
    assert other.usage.input_tokens_details.cached_tokens < 32  # only the template's head
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**body, extra_body={"cache_salt": "bad salt!!"})


def test_stream_has_the_semantic_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="demo", input="Say something.", max_output_tokens=6, stream=True, temperature=0
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert last.output_text == deltas and last.usage.output_tokens == 6


def test_streamed_json_schema_completes_and_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    with client.responses.stream(
        model="demo", input="Count.", max_output_tokens=64, text={"format": fmt}
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), ANSWER)
    whole = client.responses.create(
        model="demo", input="Count.", max_output_tokens=64, text={"format": fmt}
    )
    jsonschema.validate(json.loads(whole.output_text), ANSWER)


def test_function_tool_loop_with_previous_response_id(client: openai.OpenAI) -> None:
    rules = instructions()
    first = client.responses.create(
        model="demo",
        instructions=rules,
        input="What is evicted first?",
        tools=[LOOKUP],
        tool_choice={"type": "function", "name": "lookup"},
        max_output_tokens=64,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "lookup" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), LOOKUP["parameters"])
    assert first.status == "completed"
    second = client.responses.create(
        model="demo",
        instructions=rules,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "LRU."}],
        tools=[LOOKUP],
        max_output_tokens=4,
    )
    assert second.previous_response_id == first.id
    # The stored turn plus the tool result: step 1's prompt is a cached prefix, all its full
    # blocks at least (a partial last block is reused once filled, here by the call).
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16


def test_streamed_function_call_arguments(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="demo",
        input="Look it up.",
        tools=[LOOKUP],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(deltas) == json.loads(call.arguments)
    assert any(e.type == "response.function_call_arguments.done" for e in events)


def test_history_as_input_items(client: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "nothing"},
        {"role": "user", "content": "Thanks"},
    ]
    reply = client.responses.create(model="demo", input=items, tools=[LOOKUP], max_output_tokens=3)
    assert reply.usage.input_tokens > 20


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input", "input_file"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0]"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
        ({"input": "x", "background": True}, "background", "not supported"),
        # answered with "logprobs": [] before: silently no data
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format", "schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ""),
        ({"input": []}, "input", "empty"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "tools"),
    ],
)
def test_bad_requests_get_openai_errors(
    tools_sidecar: Server, body: dict, param: str, words: str
) -> None:
    response = httpx.post(f"{tools_sidecar.url}/responses", json={"model": "demo", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_no_reasoning_effort_is_served(tools_sidecar: Server) -> None:
    """``reasoning: {"effort": "none"}`` asks for what is served (no reasoning); any other
    effort stays a 400 (above)."""
    for reasoning in ({"effort": "none"}, {"effort": None, "summary": None}, {}):
        body = {"model": "demo", "input": "x", "max_output_tokens": 2, "reasoning": reasoning}
        response = httpx.post(f"{tools_sidecar.url}/responses", json=body, timeout=60)
        assert response.status_code == 200, response.text


def test_stored_responses_are_per_tenant(api_tenant_server: Server) -> None:
    def post(key: str, **body: object) -> httpx.Response:
        headers = {"authorization": f"Bearer {API_KEYS[key]['key']}"}
        body = {"model": "demo", "max_output_tokens": 2, **body}
        return httpx.post(
            f"{api_tenant_server.url}/responses", json=body, headers=headers, timeout=60
        )

    first = post("x", input="Remember this.")
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    assert post("x", input="Go on.", previous_response_id=rid).status_code == 200
    other = post("y", input="Go on.", previous_response_id=rid)
    assert (
        other.status_code == 400 and other.json()["error"]["code"] == "previous_response_not_found"
    )
    unstored = post("x", input="Forget this.", store=False).json()["id"]
    assert post("x", input="x", previous_response_id=unstored).status_code == 400


def test_the_store_is_bounded_per_tenant_and_in_all() -> None:
    store = ResponseStore(tenant_bytes=2000, total_bytes=3000)
    turn = [Message("user", "x" * 400)]
    for i in range(10):
        store.put("a", f"a{i}", turn)
        store.put("b", f"b{i}", turn)
    assert store.get("a", "a0") is None and store.get("a", "a9") == turn
    assert store.get("b", "b9") == turn
    assert len(store) <= 6
    store.put("c", "huge", [Message("user", "x" * 5000)])  # larger than a tenant's share
    assert store.get("c", "huge") is None


def test_a_named_function_streams_its_arguments_as_generated(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="demo",
        input="Look it up.",
        tools=[LOOKUP],
        tool_choice={"type": "function", "name": "lookup"},
        max_output_tokens=64,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2  # token by token
    (call,) = final.output
    assert call.type == "function_call" and call.name == "lookup"
    assert json.loads("".join(pieces)) == json.loads(call.arguments)
    jsonschema.validate(json.loads(call.arguments), LOOKUP["parameters"])
    assert [e.type for e in events][-2:] == ["response.output_item.done", "response.completed"]


def test_extended_retention_pins_the_input(
    tools_sidecar: Server, api_tenant_server: Server
) -> None:
    # Tenant x's own namespace: the hint pins of one namespace are capped, and the Messages
    # tests fill the default tenant's share.
    client = openai.OpenAI(
        base_url=api_tenant_server.url, api_key=API_KEYS["x"]["key"], max_retries=0
    )

    def pinned() -> int:  # the same engine's stats, on the app without keys
        stats = httpx.get(f"{tools_sidecar.root}/v1/cache/stats", timeout=10).json()
        return stats["blocks"]["pinned"]

    before = pinned()
    client.responses.create(
        model="demo", instructions=instructions(), input="x", max_output_tokens=1
    )
    assert pinned() <= before  # (an earlier test's 5m pin may lapse meanwhile)
    client.responses.create(
        model="demo",
        instructions=instructions(),
        input="x",
        max_output_tokens=1,
        prompt_cache_retention="24h",
    )
    deadline = time.monotonic() + 30  # bounds a hang only: generous for a loaded box
    while time.monotonic() < deadline:  # stats are the engine's snapshot after its next step
        if pinned() > before:
            break
        time.sleep(0.05)
    assert pinned() > before
