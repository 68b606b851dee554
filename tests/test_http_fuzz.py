"""Fuzz of the HTTP surface (issue 18): hypothesis bodies over the request schemas, with
wrong types, extreme numbers, odd unicode and deep nesting. Never a 5xx, every error in its
endpoint's shape (Anthropic's for /v1/messages, OpenAI's elsewhere), in-band stream errors too; the server is healthy afterwards with no block in
use. Runs against the app over the fake engine (many examples) and the real demo engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Server, ServerLoop, demo_engine, serve, wait_for_idle_blocks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROLES = ["system", "developer", "user", "assistant", "tool", "", "USER"]
EXTREME_NUMBERS = [0, 1, -1, 2, 1e-300, 5e-324, 1e-46, 1e308, -1e308, 2**63, 2**64, -(2**63), 0.5]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EXTREME_NUMBERS),
    st.text(max_size=40),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
numbers = st.one_of(st.sampled_from(EXTREME_NUMBERS), st.floats(-5, 5), junk)
small_max_tokens = st.one_of(st.integers(1, 3), st.integers(10**4, 10**12), junk)


@st.composite
def deep(draw: Any) -> Any:
    """A value nested hundreds or thousands deep (a list or an object)."""
    depth = draw(st.sampled_from([50, 300, 900, 1200, 5000]))
    value: Any = draw(scalars)
    wrap_list = draw(st.booleans())
    for _ in range(depth):
        value = [value] if wrap_list else {"a": value}
    return value


any_value = st.one_of(junk, deep())
content = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=60),
    st.just("\ud800 lone surrogate"),
    st.just("\x00 nul and \u202e bidi and \ufeff bom"),
    st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=2
    ),
    junk,
)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ROLES), junk), "content": content}
)
segment = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(ROLES), junk),
        "content": content,
        "tag": st.one_of(st.text(max_size=10), junk),
    },
    optional={
        "stability": st.one_of(
            st.sampled_from(["static", "shared", "session", "dynamic", "x"]), junk
        )
    },
)
SAMPLING = {
    "model": st.one_of(st.sampled_from(["demo", "fake", "nope"]), junk),
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "seed": numbers,
    "n": numbers,
    "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "stop": st.one_of(st.lists(st.text(max_size=5), max_size=20), st.text(max_size=5), junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 10**6), max_size=4), junk),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "cache_salt": st.one_of(st.sampled_from(["a", "abc\n", "a/b", "ok.salt-1:x", ""]), junk),
    "priority": numbers,
    "user": any_value,
    "metadata": any_value,
}
CHAT_ONLY = {
    "max_completion_tokens": small_max_tokens,
    "logprobs": st.one_of(st.booleans(), junk),
    "top_logprobs": numbers,
    "chat_template_kwargs": any_value,
    "add_generation_prompt": st.one_of(st.booleans(), junk),
    "continue_final_message": st.one_of(st.booleans(), junk),
    "response_format": any_value,
    "tools": any_value,
}
chat_body = st.fixed_dictionaries(
    {
        "max_tokens": small_max_tokens,
        "messages": st.one_of(st.lists(message, max_size=3), junk),
    },
    optional={**SAMPLING, **CHAT_ONLY, "segments": st.lists(segment, max_size=3)},
)
segments_body = st.fixed_dictionaries(
    {
        "max_tokens": small_max_tokens,
        "segments": st.one_of(st.lists(segment, min_size=1, max_size=4), junk),
    },
    optional=SAMPLING,
)
completion_body = st.fixed_dictionaries(
    {
        "max_tokens": small_max_tokens,
        "prompt": st.one_of(
            content,
            st.lists(st.integers(-3, 300), max_size=6),
            st.lists(st.text(max_size=5), max_size=2),
        ),
    },
    optional={**SAMPLING, "logprobs": numbers, "echo": junk, "suffix": junk},
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "no name"])}, optional={"parameters": any_value}
        ),
    }
)
cache_body = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(message, max_size=2),
        "segments": st.lists(segment, max_size=2),
        "pin": st.one_of(st.booleans(), junk),
        "cache_salt": SAMPLING["cache_salt"],
        "include_pinned": st.one_of(st.booleans(), junk),
        "name": st.one_of(st.sampled_from(["pinned", "../x", ".h", "a\n"]), junk),
        "chat_template_kwargs": any_value,
        # chat's prompt fields, rendered as chat renders them
        "tools": st.one_of(st.lists(tool, max_size=2), any_value),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), any_value),
        "documents": st.one_of(
            st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=8)), max_size=2), junk
        ),
        "add_special_tokens": st.one_of(st.booleans(), junk),
        "continue_final_message": st.one_of(st.booleans(), junk),
        "add_generation_prompt": st.one_of(st.booleans(), junk),
    },
)
# The Messages API (Anthropic's shapes) and the Responses API (OpenAI's).
cache_control = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["ephemeral", "persistent"])},
        optional={"ttl": st.sampled_from(["5m", "1h", "2h"])},
    ),
    junk,
)
block = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=20)},
        optional={"cache_control": cache_control},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.sampled_from(["toolu_1", ""]),
            "name": st.sampled_from(["lookup", "a b", ""]),
            "input": st.one_of(st.just({"key": "x"}), any_value),
        },
        optional={"cache_control": cache_control},
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["toolu_1", "x"])},
        optional={"content": content, "is_error": junk, "cache_control": cache_control},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking", "x"])}),
    junk,
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), junk),
        "content": st.one_of(st.text(max_size=30), st.lists(block, max_size=3), junk),
    }
)
anthropic_tools = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "name": st.sampled_from(["lookup", "a b", ""]),
                "input_schema": st.one_of(st.just({"type": "object"}), any_value),
            },
            optional={"cache_control": cache_control, "type": st.sampled_from(["custom", "bash"])},
        ),
        max_size=2,
    ),
    junk,
)
anthropic_tool_choice = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
        optional={"name": st.sampled_from(["lookup", "x"]), "disable_parallel_tool_use": junk},
    ),
    junk,
)
messages_body = st.fixed_dictionaries(
    {
        "max_tokens": small_max_tokens,
        "messages": st.one_of(st.lists(anthropic_message, max_size=3), junk),
    },
    optional={
        "model": SAMPLING["model"],
        "system": st.one_of(st.text(max_size=20), st.lists(block, max_size=2), junk),
        "tools": anthropic_tools,
        "tool_choice": anthropic_tool_choice,
        "temperature": numbers,
        "top_p": numbers,
        "top_k": numbers,
        "stop_sequences": st.one_of(st.lists(st.text(max_size=4), max_size=3), junk),
        "stream": st.one_of(st.booleans(), junk),
        "cache_control": cache_control,
        "metadata": any_value,
        "thinking": any_value,
        "output_config": any_value,
    },
)
response_item = st.one_of(
    message,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "function_call_output", "message", "x"])},
        optional={
            "call_id": st.one_of(st.sampled_from(["call_1", ""]), junk),
            "name": st.one_of(st.sampled_from(["lookup", "a b"]), junk),
            "arguments": st.one_of(st.sampled_from(["{}", "[1]", "{"]), junk),
            "output": content,
            "role": st.one_of(st.sampled_from(ROLES), junk),
            "content": content,
        },
    ),
    junk,
)
function_tools = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"])},
            optional={"name": st.sampled_from(["lookup", "a b"]), "parameters": any_value},
        ),
        max_size=2,
    ),
    junk,
)
responses_body = st.fixed_dictionaries(
    {"input": st.one_of(content, st.lists(response_item, max_size=3), junk)},
    optional={
        "model": SAMPLING["model"],
        "instructions": st.one_of(st.text(max_size=20), junk),
        "max_output_tokens": small_max_tokens,
        "temperature": numbers,
        "top_p": numbers,
        "tools": function_tools,
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "required", "none", "x"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": st.just("lookup")}),
            junk,
        ),
        "text": st.one_of(
            st.fixed_dictionaries(
                {
                    "format": st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                        optional={"name": st.just("a"), "schema": any_value},
                    )
                }
            ),
            junk,
        ),
        "prompt_cache_key": any_value,
        "previous_response_id": st.one_of(st.sampled_from(["resp_x", ""]), junk),
        "stream": st.one_of(st.booleans(), junk),
        "store": st.one_of(st.booleans(), junk),
        "reasoning": any_value,
        "metadata": any_value,
    },
)
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
ROUTES = [
    ("/v1/messages", messages_body),
    ("/v1/messages/count_tokens", messages_body),
    ("/v1/responses", responses_body),
    ("/v1/chat/completions", chat_body),
    ("/v1/chat/completions", segments_body),
    ("/v1/completions", completion_body),
    ("/v1/cache/warm", cache_body),
    ("/v1/cache/unpin", cache_body),
    ("/v1/cache/evict", cache_body),
]
request = st.one_of(
    *(st.tuples(st.just(path), body) for path, body in ROUTES),
    st.tuples(st.sampled_from([p for p, _ in ROUTES]), any_value),  # not even an object
)


def encode(body: Any) -> bytes:
    try:
        return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):  # too deep for json.dumps itself: build the text
        return b"[" * 3000 + b"]" * 3000


def check(response: httpx.Response, path: str = "") -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if path in ANTHROPIC_PATHS:
        check_anthropic(response)
    elif path == "/v1/responses" and response.status_code < 400 and _is_stream(response):
        check_responses_stream(response)
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        frames = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert frames and frames[-1] == "[DONE]", response.text[-300:]
        for frame in frames[:-1]:
            payload = json.loads(frame)
            if "error" in payload:  # an in-band error: the shape, never a server error
                assert set(payload["error"]) == {"message", "type", "param", "code"}
                assert payload["error"]["type"] != "server_error", payload


def _is_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _events(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]


def check_anthropic(response: httpx.Response) -> None:
    """Anthropic's shapes: ``{"type": "error", "error": {"type", "message"}}``, in-band too."""
    if response.status_code >= 400:
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] != "api_error" and body["error"]["message"]
    elif _is_stream(response):
        events = _events(response)
        assert events[0]["type"] == "message_start", events[:1]
        for event in events:
            if event["type"] == "error":
                assert event["error"]["type"] != "api_error", event
        assert events[-1]["type"] in ("message_stop", "error"), events[-1]


def check_responses_stream(response: httpx.Response) -> None:
    events = _events(response)
    assert events[0]["type"] == "response.created", events[:1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        if event["type"] == "error":
            assert event["code"] != "server_error", event
    final = ("response.completed", "response.incomplete", "response.failed")
    assert events[-1]["type"] in final, events[-1]


def fuzz(server: Server, path: str, body: Any) -> None:
    response = httpx.post(
        f"{server.root}{path}",
        content=encode(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    check(response, path)


@pytest.fixture(scope="module")
def fuzz_server(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[Server]:
    """A real engine of the fuzz's own: the Messages and Responses bodies it draws carry
    cache_control and retention marks, whose TTL pins must not outlive it into the shared
    sidecar's tests (they survive an evict, by design)."""
    from prefixcache.sidecar.server.app import SidecarSettings, create_app

    server = serve(server_loop, create_app(demo_engine(demo_loaded), SidecarSettings()))
    yield server
    server.stop()


FAST = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
REAL = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))


@FAST
@given(request)
def test_fuzz_the_app_over_the_fake_engine(fake_server: Server, case: tuple[str, Any]) -> None:
    fuzz(fake_server, *case)


@pytest.mark.timeout(240)
@REAL
@given(request)
def test_fuzz_the_real_engine(fuzz_server: Server, case: tuple[str, Any]) -> None:
    fuzz(fuzz_server, *case)


@pytest.mark.timeout(120)
def test_servers_are_healthy_after_the_fuzz(fake_server: Server, fuzz_server: Server) -> None:
    for server in (fake_server, fuzz_server):
        assert httpx.get(f"{server.root}/health", timeout=10).json() == {"status": "ok"}
    stats = wait_for_idle_blocks(fuzz_server.root, timeout=60)
    assert stats["blocks"]["in_use"] == 0
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (
        httpx.post(f"{fuzz_server.url}/chat/completions", json=body, timeout=60).status_code == 200
    )
