"""One usage shape across backends, and AsyncClient sending the SDK's own renderings to the
OpenAI and Anthropic APIs. Mock transports answer in each API's documented shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from prefixcache.sdk import (
    AsyncClient,
    BadRequestError,
    Client,
    Prompt,
    StreamError,
    UnsupportedError,
    Usage,
)
from prefixcache.sdk.anthropic_wire import AnthropicUsage, to_usage
from prefixcache.sdk.types import ChatCompletion, to_completion

LOOPS = pytest.mark.parametrize("loop", ["asyncio", "trio"])

PROMPT = (
    Prompt.builder()
    .static("You are terse.", tag="rules")
    .tool("lookup", "Look a colour up.", {"type": "object", "properties": {}})
    .shared("Doc: the sky is blue.", tag="doc")
    .dynamic("What colour is the sky?", tag="q")
    .build()
)


def _run(loop: str, fn: Callable[[], Awaitable[None]]) -> None:
    anyio.run(fn, backend=loop)


def _usage_of(payload: dict[str, Any]) -> Usage:
    return to_completion(msgspec.convert(payload, ChatCompletion)).usage


# --- the usage shape, backend by backend -------------------------------------------------------

OPENAI_USAGE = {  # OpenAI chat.completion usage, as documented
    "prompt_tokens": 2006,
    "completion_tokens": 300,
    "total_tokens": 2306,
    "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
}


def test_usage_from_openai() -> None:
    u = _usage_of({"choices": [], "usage": OPENAI_USAGE})
    assert (u.prompt_tokens, u.cached_tokens, u.uncached_tokens) == (2006, 1920, 86)
    assert u.cache_write_tokens == 0  # OpenAI does not report (or charge) writes


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 500, "completion_tokens": 7, "total_tokens": 507},  # vLLM default
        {
            "prompt_tokens": 500,
            "completion_tokens": 7,
            "total_tokens": 507,
            "prompt_tokens_details": None,
        },
        {
            "prompt_tokens": 500,
            "completion_tokens": 7,
            "total_tokens": 507,
            "prompt_tokens_details": {"cached_tokens": 448},  # vLLM / SGLang with cache report
        },
    ],
)
def test_usage_from_openai_compatible_servers(usage: dict[str, Any]) -> None:
    u = _usage_of({"choices": [], "usage": usage})
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0)
    assert (u.prompt_tokens, u.cached_tokens, u.uncached_tokens) == (500, cached, 500 - cached)
    assert u.cache_write_tokens == 0


def test_usage_from_prefixcache_takes_writes_from_the_report() -> None:
    report = {"cached_tokens": 32, "prompt_tokens": 50, "computed_tokens": 18, "segments": []}
    usage = {**OPENAI_USAGE, "prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 32}}
    u = _usage_of({"choices": [], "usage": usage, "prefixcache": report})
    assert (u.prompt_tokens, u.cached_tokens, u.uncached_tokens, u.cache_write_tokens) == (
        50,
        32,
        18,
        18,
    )
    # a report without usage still fills the shape
    u = _usage_of({"choices": [], "prefixcache": report})
    assert (u.prompt_tokens, u.cached_tokens, u.cache_write_tokens) == (50, 32, 18)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # input_tokens counts only what is neither read from nor written to the cache
        (
            {"input_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2048},
            (2060, 2048, 12, 0),
        ),
        (
            {"input_tokens": 12, "cache_creation_input_tokens": 2048, "cache_read_input_tokens": 0},
            (2060, 0, 2060, 2048),
        ),
        ({"input_tokens": 30}, (30, 0, 30, 0)),  # no caching fields at all
    ],
)
def test_usage_from_anthropic(raw: dict[str, int], expected: tuple[int, ...]) -> None:
    u = to_usage(msgspec.convert({**raw, "output_tokens": 5}, AnthropicUsage))
    assert (u.prompt_tokens, u.cached_tokens, u.uncached_tokens, u.cache_write_tokens) == expected
    assert u.completion_tokens == 5 and u.total_tokens == expected[0] + 5


# --- backend="openai" ---------------------------------------------------------------------------

OPENAI_COMPLETION = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1,
    "model": "gpt-4o-2024-08-06",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Blue.", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": OPENAI_USAGE,
    "system_fingerprint": "fp_1",
}


@LOOPS
def test_openai_backend_sends_the_openai_rendering(loop: str) -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=OPENAI_COMPLETION)

    async def main() -> None:
        async with AsyncClient(
            backend="openai",
            api_key="sk-test",
            model="gpt-4o",
            transport=httpx.MockTransport(handle),
        ) as client:
            out = await client.complete(PROMPT, max_tokens=8)
            assert out.text == "Blue." and out.usage.cached_tokens == 1920 and out.cache is None
            with pytest.raises(UnsupportedError):
                await client.warm(PROMPT)

    _run(loop, main)
    (request,) = seen
    assert str(request.url) == "https://api.openai.com/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    body = json.loads(request.content)
    assert body == {**PROMPT.to_openai(model="gpt-4o"), "max_tokens": 8, "stream": False}
    assert body["prompt_cache_key"] == PROMPT.fingerprint().cache_key()


@LOOPS
def test_openai_backend_streams_with_usage(loop: str) -> None:
    def chunk(body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"

    events = (
        chunk(
            {
                "id": "c",
                "model": "gpt-4o",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
        )
        + chunk(
            {"id": "c", "model": "gpt-4o", "choices": [{"index": 0, "delta": {"content": "Blue."}}]}
        )
        + chunk(
            {
                "id": "c",
                "model": "gpt-4o",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
        )
        + chunk({"id": "c", "model": "gpt-4o", "choices": [], "usage": OPENAI_USAGE})
        + "data: [DONE]\n\n"
    )
    bodies: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    async def main() -> None:
        async with AsyncClient(
            "http://vllm.test/v1", backend="openai", transport=httpx.MockTransport(handle)
        ) as client:
            stream = client.stream(PROMPT, max_tokens=8)
            async for _ in stream:
                pass
            assert stream.text == "Blue." and stream.finish_reason == "stop"
            assert stream.usage is not None and stream.usage.uncached_tokens == 86
            assert client.cache_report().requests == 1

    _run(loop, main)
    assert bodies[0]["stream_options"] == {"include_usage": True} and "segments" not in bodies[0]


# --- backend="anthropic" ------------------------------------------------------------------------

ANTHROPIC_MESSAGE = {
    "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "Blue."}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 12,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2048,
        "output_tokens": 3,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "service_tier": "standard",
    },
}


@LOOPS
def test_anthropic_backend_sends_the_anthropic_rendering(loop: str) -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=ANTHROPIC_MESSAGE)

    async def main() -> None:
        async with AsyncClient(
            backend="anthropic",
            api_key="sk-ant-test",
            model="claude-sonnet-4-5",
            transport=httpx.MockTransport(handle),
        ) as client:
            out = await client.complete(PROMPT, max_tokens=16, stop="END", ttl="1h")
            assert (out.text, out.finish_reason, out.model) == (
                "Blue.",
                "stop",
                "claude-sonnet-4-5",
            )
            u = out.usage
            assert (u.prompt_tokens, u.cached_tokens, u.uncached_tokens) == (2060, 2048, 12)
            with pytest.raises(ValueError, match="max_tokens"):
                await client.complete(PROMPT)
            with pytest.raises(UnsupportedError):
                await client.cache_stats()

    _run(loop, main)
    (request,) = seen
    assert str(request.url) == "https://api.anthropic.com/v1/messages"
    assert request.headers["x-api-key"] == "sk-ant-test"
    assert request.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in request.headers
    body = json.loads(request.content)
    expected = PROMPT.to_anthropic(model="claude-sonnet-4-5", max_tokens=16, ttl="1h")
    assert body == {**expected, "stop_sequences": ["END"], "stream": False}
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


ANTHROPIC_STREAM = (
    _sse(
        "message_start",
        {
            "type": "message_start",
            "message": {
                **ANTHROPIC_MESSAGE,
                "content": [],
                "stop_reason": None,
                "usage": {
                    "input_tokens": 12,
                    "cache_creation_input_tokens": 2048,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 1,
                },
            },
        },
    )
    + _sse(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    + _sse("ping", {"type": "ping"})
    + _sse(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Bl"}},
    )
    + _sse(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ue."}},
    )
    + _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    + _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": 3},
        },
    )
    + _sse("message_stop", {"type": "message_stop"})
)


@LOOPS
def test_anthropic_backend_streams_text_and_usage(loop: str) -> None:
    bodies: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(
            200, text=ANTHROPIC_STREAM, headers={"content-type": "text/event-stream"}
        )

    async def main() -> None:
        async with AsyncClient(
            backend="anthropic", transport=httpx.MockTransport(handle)
        ) as client:
            stream = client.stream(PROMPT, max_tokens=3)
            texts = [d.text async for d in stream if d.text]
            assert texts == ["Bl", "ue."] and stream.text == "Blue."
            assert stream.finish_reason == "length" and stream.model == "claude-sonnet-4-5"
            u = stream.usage
            assert u is not None
            assert (u.prompt_tokens, u.cached_tokens, u.cache_write_tokens) == (2060, 0, 2048)
            assert (u.completion_tokens, u.total_tokens) == (3, 2063)
            report = client.cache_report()
            assert report.requests == 1 and report.cache_write_tokens == 2048

    _run(loop, main)
    assert bodies[0]["stream"] is True and "stream_options" not in bodies[0]


@LOOPS
def test_anthropic_errors_map_to_typed_exceptions(loop: str) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["stream"]:
            error = {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
            }
            text = _sse("message_start", {"type": "message_start", "message": ANTHROPIC_MESSAGE})
            return httpx.Response(
                200, text=text + _sse("error", error), headers={"content-type": "text/event-stream"}
            )
        body = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: too large"},
        }
        return httpx.Response(400, json=body)

    async def main() -> None:
        async with AsyncClient(
            backend="anthropic", transport=httpx.MockTransport(handle)
        ) as client:
            with pytest.raises(BadRequestError) as bad:
                await client.complete(PROMPT, max_tokens=10**9)
            assert bad.value.error_type == "invalid_request_error"
            with pytest.raises(StreamError, match="Overloaded"):
                async for _ in client.stream(PROMPT, max_tokens=4):
                    pass

    _run(loop, main)


def test_plain_messages_go_to_anthropic_too() -> None:
    seen: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=ANTHROPIC_MESSAGE)

    with Client(backend="anthropic", transport=httpx.MockTransport(handle)) as client:
        out = client.complete(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            max_tokens=4,
        )
        assert out.text == "Blue." and client.cache_report().requests == 1
    assert seen[0]["system"] == [{"type": "text", "text": "Be brief."}]
    assert seen[0]["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend"):
        AsyncClient(backend="bedrock")  # type: ignore[arg-type]


def test_sync_client_still_takes_the_event_loop_as_backend() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=OPENAI_COMPLETION)

    with Client("http://x.test/v1", backend="trio", transport=httpx.MockTransport(handle)) as c:
        assert c.complete([{"role": "user", "content": "hi"}]).text == "Blue."


def test_the_sidecar_messages_wire_sends_the_anthropic_rendering() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = {
            "id": "msg_1",
            "model": "demo",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 3, "output_tokens": 1, "cache_creation_input_tokens": 20},
            "prefixcache": {
                "cached_tokens": 0,
                "prompt_tokens": 23,
                "computed_tokens": 23,
                "segments": [],
            },
        }
        return httpx.Response(200, json=body)

    transport = httpx.MockTransport(handle)
    with Client("http://sidecar/v1", "sk-x", wire="messages", transport=transport) as client:
        out = client.complete(PROMPT, max_tokens=16, ttl="1h")
    (request,) = seen
    assert str(request.url) == "http://sidecar/v1/messages"
    assert request.headers["authorization"] == "Bearer sk-x"
    assert request.headers["anthropic-version"] == "2023-06-01"
    expected = PROMPT.to_anthropic(max_tokens=16, ttl="1h")
    assert json.loads(request.content) == {**expected, "stream": False}
    assert out.usage.prompt_tokens == 23 and out.usage.cache_write_tokens == 20
    assert out.cache is not None and out.cache.computed_tokens == 23
    with pytest.raises(ValueError, match="wire"):
        Client(backend="openai", wire="messages")
