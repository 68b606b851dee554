"""The Messages API (issue 26) with the official ``anthropic`` client against a live sidecar
on the demo model (a tools template installed): create, stream (text and tool use), a
two-step tool loop, count_tokens, the cache counters as Anthropic defines them, and errors in
Anthropic's shape with its status codes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from conftest import API_KEYS, Server
from sidecar_fake_engine import FakeEngine

from prefixcache.sidecar.server.app import SidecarSettings, create_app

pytest.importorskip("llguidance")

LOOKUP = {
    "name": "lookup",
    "description": "Look a document up by key.",
    "input_schema": {
        "type": "object",
        "properties": {"key": {"enum": ["eviction", "pinning", "blocks"]}},
        "required": ["key"],
    },
}
QUESTION = [{"role": "user", "content": "What is evicted first?"}]
EPHEMERAL = {"type": "ephemeral"}
BLOCK = 16  # the engine's block size
GREEDY = {"temperature": 0}  # today's client has no sampling arguments; the API takes them


@pytest.fixture(scope="module")
def client(tools_sidecar: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=tools_sidecar.root, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def unique_system(marked: bool = True, ttl: str | None = None) -> list[dict[str, Any]]:
    """A long system prompt no other test sends (so its first request is a cache miss)."""
    block: dict[str, Any] = {
        "type": "text",
        "text": f"Run {uuid.uuid4().hex}. You answer questions about caches. " * 12,
    }
    if marked:
        block["cache_control"] = dict(EPHEMERAL, **({"ttl": ttl} if ttl else {}))
    return [block]


def prompt_of(usage: Any) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def test_create_answers_in_the_message_shape(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-test", max_tokens=6, messages=QUESTION, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "claude-test"  # as asked
    assert message.stop_reason in ("end_turn", "max_tokens")
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.usage.output_tokens == 6 or message.stop_reason == "end_turn"
    # No breakpoint: no cache traffic in Anthropic's counters, however much the engine reused.
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model="claude-test", messages=QUESTION)
    assert counted.input_tokens == message.usage.input_tokens


def test_breakpoints_report_cache_writes_then_reads(client: anthropic.Anthropic) -> None:
    system = unique_system()
    first = client.messages.create(
        model="demo", max_tokens=4, system=system, messages=QUESTION, extra_body=GREEDY
    )
    # Only the template's head (shared with every prompt) was cached before; the rest of the
    # prefix up to the breakpoint is written now.
    written = first.usage.cache_creation_input_tokens
    assert written > 100 and first.usage.cache_read_input_tokens < 32
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == written
    prefix = written + first.usage.cache_read_input_tokens
    other = [{"role": "user", "content": "And what is pinned?"}]
    second = client.messages.create(
        model="demo", max_tokens=4, system=system, messages=other, extra_body=GREEDY
    )
    assert second.usage.cache_read_input_tokens == prefix
    assert second.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model="demo", system=system, messages=other)
    assert prompt_of(second.usage) == counted.input_tokens
    # The engine's own report (extension field) agrees it served at least the prefix.
    assert second.model_extra["prefixcache"]["cached_tokens"] >= prefix


def test_cache_salt_narrows_the_namespace(client: anthropic.Anthropic) -> None:
    """vLLM's cache_salt works here as on chat (it was ignored: another salt still hit)."""
    system = unique_system()
    body = dict(model="demo", max_tokens=2, system=system, messages=QUESTION)
    client.messages.create(**body, extra_body={**GREEDY, "cache_salt": "alice"})
    again = client.messages.create(**body, extra_body={**GREEDY, "cache_salt": "alice"})
    other = client.messages.create(**body, extra_body={**GREEDY, "cache_salt": "bob"})
    assert again.usage.cache_read_input_tokens > 100
    assert other.usage.cache_read_input_tokens < 32  # only the template's head
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**body, extra_body={"cache_salt": "bad salt!!"})


def test_one_hour_breakpoints_are_counted_apart(client: anthropic.Anthropic) -> None:
    system = unique_system(ttl="1h")
    # A question of more than a block: the last breakpoint's end, which counts as far as the
    # prompt's last whole block, is past the system's.
    question = [{"role": "user", "content": "What is evicted first, and what is pinned? " * 4}]
    message = client.messages.create(
        model="demo", max_tokens=2, system=system, messages=question, cache_control=EPHEMERAL
    )
    usage = message.usage
    assert usage.cache_creation.ephemeral_1h_input_tokens > 100
    assert usage.cache_creation.ephemeral_5m_input_tokens > 0  # system end -> last block
    assert usage.cache_creation_input_tokens == (
        usage.cache_creation.ephemeral_1h_input_tokens
        + usage.cache_creation.ephemeral_5m_input_tokens
    )
    assert usage.input_tokens > 0  # the generation prompt, after the last breakpoint


def test_stream_has_the_event_sequence_and_the_whole_usage(client: anthropic.Anthropic) -> None:
    system = unique_system()
    with client.messages.stream(
        model="demo", max_tokens=8, system=system, messages=QUESTION, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]  # "text": the helper's own events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    deltas = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert final.content[0].text == deltas
    assert final.usage.output_tokens == 8 and final.stop_reason == "max_tokens"
    assert final.usage.cache_creation_input_tokens > 100
    whole = client.messages.create(
        model="demo", max_tokens=8, system=system, messages=QUESTION, extra_body=GREEDY
    )
    assert whole.content[0].text == deltas  # greedy: the same answer, now from the cache
    prefix = final.usage.cache_creation_input_tokens + final.usage.cache_read_input_tokens
    assert whole.usage.cache_read_input_tokens == prefix


def test_raw_events_are_named_and_typed_alike(tools_sidecar: Server) -> None:
    body = {"model": "demo", "max_tokens": 3, "messages": QUESTION, "stream": True}
    names, types = [], []
    with httpx.stream("POST", f"{tools_sidecar.root}/v1/messages", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                types.append(json.loads(line[6:])["type"])
    assert names == types
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_name_the_one_that_matched(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="demo", max_tokens=12, messages=QUESTION, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2
    cut = client.messages.create(
        model="demo", max_tokens=12, messages=QUESTION, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text if cut.content else "")


def test_forced_tool_use_and_a_two_step_loop(client: anthropic.Anthropic) -> None:
    system = unique_system(marked=False)
    first = client.messages.create(
        model="demo",
        max_tokens=64,
        system=system,
        messages=QUESTION,
        tools=[LOOKUP],
        tool_choice={"type": "tool", "name": "lookup"},
        cache_control=EPHEMERAL,
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "lookup" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, LOOKUP["input_schema"])
    step_one = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    step_one_prompt = step_one + first.usage.input_tokens
    assert first.usage.cache_creation_input_tokens > 100
    history = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "LRU leaves."}],
        },
    ]
    second = client.messages.create(
        model="demo",
        max_tokens=4,
        system=system,
        messages=history,
        tools=[LOOKUP],
        cache_control=EPHEMERAL,
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # Step 2 starts with step 1's whole prompt: the part up to step 1's breakpoint is read.
    # (The engine reuses a partial last block only once it has filled: 16 tokens.)
    reusable = min(step_one, step_one_prompt // BLOCK * BLOCK)
    assert second.usage.cache_read_input_tokens >= reusable
    assert second.usage.cache_creation_input_tokens > 0  # the new turns, up to the new mark


def input_json_text(events: list[Any]) -> str:
    """The input_json_delta text of a stream's events, joined."""
    return "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )


def test_streamed_tool_use_sends_input_json_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="demo",
        max_tokens=64,
        messages=QUESTION,
        tools=[LOOKUP],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = input_json_text(events)
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads(partial) == call.input
    jsonschema.validate(call.input, LOOKUP["input_schema"])
    assert final.stop_reason == "tool_use"


def test_assistant_prefill_is_continued(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="demo", max_tokens=6, messages=QUESTION, extra_body=GREEDY)
    head = free.content[0].text[:4].rstrip() or "The"  # a prefill may not end in whitespace
    prefilled = [*QUESTION, {"role": "assistant", "content": head}]
    rest = client.messages.create(model="demo", max_tokens=5, messages=prefilled, extra_body=GREEDY)
    assert rest.content and rest.content[0].type == "text"


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        (
            {
                "max_tokens": 1,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": EPHEMERAL}] * 5,
                    }
                ],
            },
            400,
            "invalid_request_error",
            "maximum of 4",
        ),
        (
            {
                "max_tokens": 1,
                "system": [{"type": "text", "text": "s", "cache_control": EPHEMERAL}],
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "text",
                                "text": "x",
                                "cache_control": {"type": "ephemeral", "ttl": "1h"},
                            }
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "1h",
        ),
        (
            {
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
            "image",
        ),
        (
            {
                "max_tokens": 1,
                "messages": QUESTION,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            {
                "max_tokens": 1,
                "messages": QUESTION,
                "tools": [
                    {"type": "web_search_20250305", "name": "web_search", "input_schema": {}}
                ],
            },
            400,
            "invalid_request_error",
            "server tool",
        ),
        (
            {
                "max_tokens": 1,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}
                ],
            },
            400,
            "invalid_request_error",
            "no tool_use",
        ),
        (
            {
                "max_tokens": 1,
                "messages": QUESTION,
                "tool_choice": {"type": "tool", "name": "lookup"},
            },
            400,
            "invalid_request_error",
            "needs 'tools'",
        ),
        ({"messages": QUESTION}, 400, "invalid_request_error", "max_tokens"),
        (
            {"max_tokens": 1, "messages": QUESTION, "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {"max_tokens": 1, "messages": QUESTION, "model": "claude-unknown"},
            404,
            "not_found_error",
            "model",
        ),
        (
            {"max_tokens": 100000, "messages": QUESTION},
            400,
            "invalid_request_error",
            "context length",
        ),
    ],
)
def test_bad_requests_get_anthropic_errors(
    tools_sidecar: Server, body: dict, status: int, kind: str, words: str
) -> None:
    body = {"model": "demo", **body}
    response = httpx.post(f"{tools_sidecar.root}/v1/messages", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"]


def test_malformed_json_and_the_client_exceptions(
    tools_sidecar: Server, client: anthropic.Anthropic
) -> None:
    response = httpx.post(
        f"{tools_sidecar.root}/v1/messages/count_tokens", content=b"{nope", timeout=10
    )
    assert (
        response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=1, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="demo", messages=[])


def test_keys_come_as_x_api_key_or_bearer(api_tenant_server: Server) -> None:
    url = f"{api_tenant_server.root}/v1/messages/count_tokens"
    body = {"model": "demo", "messages": QUESTION}
    missing = httpx.post(url, json=body, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in missing.json()["error"]["message"]  # how to send one, both ways
    for headers in (
        {"x-api-key": API_KEYS["x"]["key"]},
        {"authorization": f"Bearer {API_KEYS['x']['key']}"},
    ):
        assert httpx.post(url, json=body, headers=headers, timeout=10).status_code == 200
    client = anthropic.Anthropic(
        base_url=api_tenant_server.root, api_key="sk-wrong-key-000", max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.count_tokens(model="demo", messages=QUESTION)


def test_tenants_never_read_each_others_breakpoints(api_tenant_server: Server) -> None:
    def create(key: str, system: list[dict[str, Any]]) -> dict:
        body = {"model": "demo", "max_tokens": 2, "system": system, "messages": QUESTION}
        headers = {"x-api-key": API_KEYS[key]["key"]}
        url = f"{api_tenant_server.root}/v1/messages"
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    system = unique_system()
    first = create("x", system)
    prefix = first["cache_creation_input_tokens"] + first["cache_read_input_tokens"]
    assert create("x", system)["cache_read_input_tokens"] == prefix  # x's own prefix
    other = create("y", system)  # the same text, another tenant: another namespace
    assert other["cache_read_input_tokens"] < 32 and other["cache_creation_input_tokens"] > 100


async def test_queue_full_and_not_ready_in_anthropics_shape() -> None:
    engine = FakeEngine()
    app = create_app(engine, SidecarSettings(manage_engine=False, max_waiting=0))
    transport = httpx.ASGITransport(app=app)
    body = {"max_tokens": 1, "messages": QUESTION}
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
        loading = await client.post("/v1/messages", json=body)
        assert loading.status_code == 503 and loading.headers["retry-after"]
        assert loading.json()["error"]["type"] == "overloaded_error"
        await engine.start()
        full = await client.post("/v1/messages", json=body)
        assert full.status_code == 429 and full.headers["retry-after"]
        assert full.json() == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": full.json()["error"]["message"]},
        }
        responses = await client.post("/v1/responses", json={"input": "x"})
        assert responses.status_code == 429
        assert responses.json()["error"]["type"] == "rate_limit_error"
        assert engine.received == []


def test_a_named_tool_streams_its_input_as_it_is_generated(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="demo",
        max_tokens=64,
        messages=QUESTION,
        tools=[LOOKUP],
        tool_choice={"type": "tool", "name": "lookup"},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(pieces) > 2  # token by token, not one delta at the end
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "lookup"
    assert json.loads("".join(pieces)) == call.input
    jsonschema.validate(call.input, LOOKUP["input_schema"])
    assert final.stop_reason == "tool_use"


def test_output_config_format_constrains_the_reply(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model="demo",
        max_tokens=48,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)
    assert message.stop_reason == "end_turn"


def pinned_blocks(root: str) -> int:
    return httpx.get(f"{root}/v1/cache/stats", timeout=10).json()["blocks"]["pinned"]


def wait_for_more_pinned(root: str, before: int) -> int:
    deadline = time.monotonic() + 30  # bounds a hang only: generous for a loaded box
    while time.monotonic() < deadline:  # stats are the engine's snapshot after its next step
        if (now := pinned_blocks(root)) > before:
            return now
        time.sleep(0.05)
    return pinned_blocks(root)


def test_a_breakpoint_becomes_a_ttl_pin(tools_sidecar: Server, api_tenant_server: Server) -> None:
    # Tenant y's own namespace: the hint pins of one namespace are capped (a quarter of the
    # pool), and this file's other tests fill the default tenant's share.
    client = anthropic.Anthropic(
        base_url=api_tenant_server.root, api_key=API_KEYS["y"]["key"], max_retries=0
    )
    root = tools_sidecar.root  # the same engine; its stats need no key
    before = pinned_blocks(root)
    client.messages.create(
        model="demo", max_tokens=1, system=unique_system(False), messages=QUESTION
    )
    assert pinned_blocks(root) <= before  # no breakpoint, no pin (an old one may lapse)
    client.messages.create(model="demo", max_tokens=1, system=unique_system(), messages=QUESTION)
    assert wait_for_more_pinned(root, before) > before


def sdk_final_usage(root: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """message_start's usage, and the usage the SDK's stream accumulator builds from it: the
    start's whole usage, then message_delta's flat counters over it (never its cache_creation:
    anthropic/lib/streaming/_messages.py)."""
    events = []
    with httpx.stream("POST", f"{root}/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[0]["type"] == "message_start"  # nothing before it (it leaves with a token)
    start = events[0]["message"]["usage"]
    final = json.loads(json.dumps(start))
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    for name in ("input_tokens", "output_tokens", "cache_creation_input_tokens"):
        final[name] = delta["usage"].get(name, final[name])
    final["cache_read_input_tokens"] = delta["usage"].get(
        "cache_read_input_tokens", final["cache_read_input_tokens"]
    )
    return start, final


@pytest.mark.parametrize(("ttl", "max_tokens"), [(None, 1), ("1h", 1), (None, 4), ("1h", 4)])
def test_streamed_usage_is_the_whole_messages_from_message_start(
    client: anthropic.Anthropic, tools_sidecar: Server, ttl: str | None, max_tokens: int
) -> None:
    """message_start carries the prompt's real split (cache_creation's TTL split too, which the
    SDK takes from message_start alone): a miss streamed reads as the same miss whole, a hit as
    the same hit. The engine's first output carries the prompt's usage, whether or not it is
    also the last."""
    root = tools_sidecar.root
    fresh = [unique_system(ttl=ttl)]
    counted = client.messages.count_tokens(model="demo", system=fresh[0], messages=QUESTION)
    body = {"model": "demo", "max_tokens": max_tokens, "messages": QUESTION}
    raw = dict(body, stream=True, **GREEDY)

    def create(system: list[dict[str, Any]]) -> dict[str, Any]:
        return client.messages.create(**body, system=system, extra_body=GREEDY).usage.model_dump()

    start, streamed = sdk_final_usage(root, dict(raw, system=fresh[0]))  # a miss
    assert prompt_of(anthropic.types.Usage(**start)) == counted.input_tokens
    assert {k: start[k] for k in start if k != "output_tokens"} == {
        k: streamed[k] for k in start if k != "output_tokens"
    }  # message_delta's counts agree with message_start's
    assert streamed["cache_creation_input_tokens"] > 100
    bucket = "ephemeral_1h_input_tokens" if ttl else "ephemeral_5m_input_tokens"
    assert streamed["cache_creation"][bucket] == streamed["cache_creation_input_tokens"]
    # Now both hit: the streamed and whole replies of the same request agree.
    _, streamed_hit = sdk_final_usage(root, dict(raw, system=fresh[0]))
    whole_hit = create(fresh[0])
    assert {k: whole_hit[k] for k in start} == {k: streamed_hit[k] for k in start}
    written = streamed["cache_read_input_tokens"] + streamed["cache_creation_input_tokens"]
    assert streamed_hit["cache_read_input_tokens"] == written
