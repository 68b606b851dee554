"""AsyncClient / Client behaviour against httpx.MockTransport, on asyncio and trio."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import MappingProxyType
from typing import Any

import anyio
import httpx
import pytest

from prefixcache.sdk import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    Client,
    InternalServerError,
    PermissionDeniedError,
    Prompt,
    RateLimitError,
    ServiceUnavailableError,
    StreamError,
    Timeouts,
    UnsupportedError,
)

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
Handler = Callable[[httpx.Request], Awaitable[httpx.Response] | httpx.Response]

PROMPT = (
    Prompt.builder()
    .static("You are terse.", tag="rules")
    .shared("Doc: the sky is blue.", tag="doc")
    .dynamic("What colour is the sky?", tag="q")
    .build()
)
REPORT = {
    "cached_tokens": 16,
    "prompt_tokens": 30,
    "computed_tokens": 14,
    "segments": [
        {"tag": "rules", "tokens": 10, "cached_tokens": 10},
        {"tag": "doc", "tokens": 8, "cached_tokens": 6},
        {"tag": "q", "tokens": 12, "cached_tokens": 0},
    ],
}
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "demo",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Blue."}, "finish_reason": "stop"}
    ],
    "usage": {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "total_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 16},
    },
    "prefixcache": REPORT,
}


def _chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "demo",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n".encode()


USAGE_CHUNK = (
    "data: " + json.dumps({"id": "c1", "choices": [], "usage": COMPLETION["usage"]}) + "\n\n"
).encode()


def _error(status: int, message: str, type_: str, code: str | None = None, **headers: str):
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return httpx.Response(status, json=body, headers=headers)


def _run(backend: str, fn: Callable[[], Awaitable[None]]) -> None:
    anyio.run(fn, backend=backend)


def _client(handler: Handler, **kwargs: Any) -> AsyncClient:
    return AsyncClient(
        "http://sidecar.test/v1", "sk-abc", transport=httpx.MockTransport(handler), **kwargs
    )


@BACKENDS
def test_complete_sends_segments_and_parses_typed_response(backend: str) -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=COMPLETION)

    async def main() -> None:
        async with _client(handle, model="demo") as client:
            out = await client.complete(PROMPT, max_tokens=4, temperature=0.0, seed=None)
        assert out.text == "Blue." and out.finish_reason == "stop" and out.model == "demo"
        assert out.usage.cached_tokens == 16 and out.usage.total_tokens == 32
        assert out.cache is not None and out.cache.segment("doc").cached_tokens == 6
        assert sum(s.cached_tokens for s in out.cache.segments) == out.cache.cached_tokens

    _run(backend, main)
    (request,) = seen
    assert request.url == "http://sidecar.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-abc"
    body = json.loads(request.content)
    assert body["segments"] == PROMPT.to_segments() and "messages" not in body
    assert body["model"] == "demo" and body["max_tokens"] == 4 and "seed" not in body


@BACKENDS
def test_plain_messages_are_sent_as_messages(backend: str) -> None:
    seen: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={**COMPLETION, "prefixcache": None})

    async def main() -> None:
        async with _client(handle) as client:
            out = await client.complete([{"role": "user", "content": "hi"}])
        assert out.text == "Blue." and out.cache is None

    _run(backend, main)
    assert seen[0]["messages"] == [{"role": "user", "content": "hi"}] and "model" not in seen[0]


@BACKENDS
@pytest.mark.parametrize("status", [429, 503])
def test_retry_honours_retry_after(backend: str, status: int) -> None:
    calls: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return _error(status, "busy", "overloaded", **{"Retry-After": "0.2"})
        return httpx.Response(200, json=COMPLETION)

    async def main() -> None:
        async with _client(handle, retry_backoff=20.0) as client:
            out = await client.complete(PROMPT)
        assert out.text == "Blue."

    _run(backend, main)
    assert len(calls) == 2
    # waited Retry-After, not the >= 15 s backoff (a loaded box's late wake-ups stay far below)
    assert 0.2 <= calls[1] - calls[0] < 10.0


@BACKENDS
def test_retries_exhausted_raise_typed_error_with_server_message(backend: str) -> None:
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return _error(
            429,
            "queue full (1024 waiting)",
            "rate_limit_error",
            "queue_full",
            **{"Retry-After": "0"},
        )

    async def main() -> None:
        async with _client(handle, max_retries=2) as client:
            with pytest.raises(RateLimitError) as info:
                await client.complete(PROMPT)
        err = info.value
        assert (err.status_code, err.error_type, err.code) == (
            429,
            "rate_limit_error",
            "queue_full",
        )
        assert err.message == "queue full (1024 waiting)" and "queue full" in str(err)
        assert err.response is not None and err.response.status_code == 429

    _run(backend, main)
    assert calls == 3


@BACKENDS
def test_client_errors_are_not_retried_and_parse_error_json(backend: str) -> None:
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if request.url.path.endswith("/cache/stats"):
            return _error(403, "admin key required", "permission_error")
        if request.url.path.endswith("/models"):
            return httpx.Response(500, json={"detail": "boom"})
        body = {"error": {"message": "segment tags must be unique", "type": "invalid_request_error",
                          "param": "segments", "code": None}}  # fmt: skip
        return httpx.Response(400, json=body)

    async def main() -> None:
        async with _client(handle) as client:
            with pytest.raises(BadRequestError) as info:
                await client.complete(PROMPT)
            assert info.value.param == "segments" and info.value.code is None
            assert info.value.message == "segment tags must be unique"
            with pytest.raises(PermissionDeniedError, match="admin key required"):
                await client.cache_stats()
            with pytest.raises(InternalServerError, match="boom"):
                await client.models()

    _run(backend, main)
    assert calls == 3


@BACKENDS
def test_plain_text_503_becomes_service_unavailable(backend: str) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="starting up")

    async def main() -> None:
        async with _client(handle, max_retries=0) as client:
            with pytest.raises(ServiceUnavailableError, match="starting up") as info:
                await client.complete(PROMPT)
        assert info.value.status_code == 503

    _run(backend, main)


@BACKENDS
def test_stream_parses_sse_deltas_usage_and_cache_report(backend: str) -> None:
    seen: list[dict[str, Any]] = []
    crlf_event = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "ue"}}]}
    sse = (
        b": keep-alive comment\n\n"
        + _chunk("")  # role-only opening chunk
        + _chunk("Bl")
        + f"data: {json.dumps(crlf_event)}\r\n\r\n".encode()  # CRLF line endings
        + _chunk(".", "stop", prefixcache=REPORT)
        + USAGE_CHUNK
        + b"data: [DONE]\n\n"
    )

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    async def main() -> None:
        async with _client(handle) as client:
            stream = client.stream(PROMPT, max_tokens=3)
            deltas = [d async for d in stream]
        assert "".join(d.text for d in deltas) == "Blue." == stream.text
        assert [d.finish_reason for d in deltas] == [None, None, None, "stop", None]
        assert deltas[3].cache is not None and deltas[3].cache.cached_tokens == 16
        assert deltas[-1].usage is not None and deltas[-1].usage.cached_tokens == 16
        assert stream.finish_reason == "stop" and stream.cache == deltas[3].cache
        assert stream.ttft is not None and stream.ttft >= 0

    _run(backend, main)
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}


@BACKENDS
def test_stream_accepts_a_plain_json_answer_from_a_server_without_streaming(backend: str) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=COMPLETION)

    async def main() -> None:
        async with _client(handle) as client:
            stream = client.stream(PROMPT)
            deltas = [d async for d in stream]
        assert [d.text for d in deltas] == ["Blue."] and stream.finish_reason == "stop"
        assert stream.usage is not None and stream.usage.cached_tokens == 16

    _run(backend, main)


@BACKENDS
def test_in_band_stream_error_raises_stream_error_without_retry(backend: str) -> None:
    calls = 0
    error = {"error": {"message": "engine failed", "type": "server_error", "code": "engine_error"}}

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        body = _chunk("Bl") + f"data: {json.dumps(error)}\n\n".encode() + b"data: [DONE]\n\n"
        return httpx.Response(200, content=body)

    async def main() -> None:
        got: list[str] = []
        async with _client(handle) as client:
            with pytest.raises(StreamError) as info:
                async for d in client.stream(PROMPT):
                    got.append(d.text)
        assert got == ["Bl"]
        assert (info.value.message, info.value.error_type, info.value.code) == (
            "engine failed", "server_error", "engine_error",
        )  # fmt: skip

    _run(backend, main)
    assert calls == 1


@BACKENDS
def test_no_retry_once_a_stream_started(backend: str) -> None:
    calls = 0

    async def body() -> AsyncIterator[bytes]:
        yield _chunk("Bl")
        raise httpx.ReadError("connection reset")

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(200, content=body())

    async def main() -> None:
        got: list[str] = []
        async with _client(handle, max_retries=3) as client:
            with pytest.raises(APIConnectionError, match="stream interrupted"):
                async for d in client.stream(PROMPT):
                    got.append(d.text)
        assert got == ["Bl"]

    _run(backend, main)
    assert calls == 1


@BACKENDS
def test_stream_retried_when_refused_before_it_started(backend: str) -> None:
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return _error(429, "busy", "rate_limit_error", **{"Retry-After": "0.05"})
        return httpx.Response(200, content=_chunk("ok", "stop") + b"data: [DONE]\n\n")

    async def main() -> None:
        async with _client(handle) as client:
            assert [d.text async for d in client.stream(PROMPT)] == ["ok"]

    _run(backend, main)
    assert calls == 2


@BACKENDS
def test_total_timeout_raises_typed_error(backend: str) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(30)  # far past the bound below, so a late wake-up cannot pass
        return httpx.Response(200, json=COMPLETION)

    async def main() -> None:
        async with _client(handle, timeouts=Timeouts(total=0.2)) as client:
            start = time.monotonic()
            with pytest.raises(APITimeoutError) as info:
                await client.complete(PROMPT)
        assert info.value.kind == "total" and time.monotonic() - start < 3.0  # 0.2 s, late

    _run(backend, main)


@BACKENDS
def test_first_token_timeout_raises_typed_error(backend: str) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield _chunk("")  # a role chunk is not a token
        await anyio.sleep(30)
        yield _chunk("late")

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    async def main() -> None:
        async with _client(handle, timeouts=Timeouts(first_token=0.2, total=5)) as client:
            start = time.monotonic()
            with pytest.raises(APITimeoutError) as info:
                async for _ in client.stream(PROMPT):
                    pass
        assert info.value.kind == "first_token" and time.monotonic() - start < 3.0

    _run(backend, main)


@BACKENDS
def test_connect_failures_are_retried_then_raised(backend: str) -> None:
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("refused")
        raise httpx.ConnectTimeout("slow")

    async def main() -> None:
        async with _client(handle, max_retries=1, retry_backoff=0.01) as client:
            with pytest.raises(APITimeoutError) as info:
                await client.complete(PROMPT)
        assert info.value.kind == "connect" and info.value.status_code is None

    _run(backend, main)
    assert calls == 2


@BACKENDS
def test_cache_admin_calls(backend: str) -> None:
    seen: list[tuple[str, str, Any]] = []
    stats = {
        "block_size": 16,
        "blocks": {"total": 64, "free": 40, "cached_idle": 20, "in_use": 4, "pinned": 2},
        "tokens": {"queries": 100, "hits": 60, "inserted": 40, "evicted": 0},
        "hit_rate": 0.6,
        "something_new": {"ignored": True},
    }

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, body))
        replies = {
            "/v1/cache/warm": {"tokens": 18, "cached_tokens": 0, "pinned_blocks": 1},
            "/v1/cache/unpin": {"unpinned_blocks": 1},
            "/v1/cache/evict": {"evicted_blocks": 20},
            "/v1/cache/stats": stats,
        }
        return httpx.Response(200, json=replies[request.url.path])

    async def main() -> None:
        async with _client(handle, model="demo") as client:
            warm = await client.warm(PROMPT, pin=True)
            assert (warm.tokens, warm.cached_tokens, warm.pinned_blocks) == (18, 0, 1)
            assert await client.unpin(PROMPT) == 1
            assert await client.evict() == 20
            s = await client.cache_stats()
            assert s.blocks.pinned == 2 and s.tokens.hits == 60 and s.hit_rate == 0.6
            # printed, the parts this server did not send are left out (not msgspec's UNSET)
            assert "UNSET" not in repr(s) and "tier" not in repr(s) and "pinned=2" in repr(s)

    _run(backend, main)
    assert [(m, p) for m, p, _ in seen] == [
        ("POST", "/v1/cache/warm"),
        ("POST", "/v1/cache/unpin"),
        ("POST", "/v1/cache/evict"),
        ("GET", "/v1/cache/stats"),
    ]
    assert seen[0][2] == {"model": "demo", "segments": PROMPT.to_segments(), "pin": True}


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
PROMPT_FIELDS: dict[str, Any] = {
    "tools": [TOOL],
    "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    "documents": [{"title": "t", "text": "the sky is blue"}],
    "add_special_tokens": True,
    "continue_final_message": False,
    "chat_template_kwargs": {"enable_thinking": False},
}


@BACKENDS
def test_warm_and_unpin_send_chats_prompt_fields(backend: str) -> None:
    """The fields that change the prompt chat renders go in warm's and unpin's bodies (any
    mappings, as JSON objects); those left out are not sent."""
    seen: list[tuple[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        if request.url.path == "/v1/cache/warm":
            return httpx.Response(200, json={"tokens": 8, "cached_tokens": 0, "pinned_blocks": 2})
        return httpx.Response(200, json={"unpinned_blocks": 2})

    frozen = {
        k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in PROMPT_FIELDS.items()
    }
    frozen["tools"] = (MappingProxyType(TOOL),)
    messages = [{"role": "system", "content": "rules"}]

    async def main() -> None:
        async with _client(handle) as client:
            assert (await client.warm(messages, pin=True, **frozen)).pinned_blocks == 2
            assert await client.unpin(messages, **frozen) == 2
            await client.warm(messages, documents=PROMPT_FIELDS["documents"])

    _run(backend, main)
    with Client("http://sidecar.test/v1", transport=httpx.MockTransport(handle)) as client:
        assert client.warm(messages, pin=True, **frozen).tokens == 8
        assert client.unpin(messages, **frozen) == 2
        for call in (client.warm, client.unpin):  # a misspelt field: nothing sent
            with pytest.raises(TypeError, match="tool_choise"):
                call(messages, tool_choise="none")  # type: ignore[call-arg]
    body = {"messages": messages, **PROMPT_FIELDS}
    warm, unpin = {**body, "pin": True}, body
    only = {"messages": messages, "pin": False, "documents": PROMPT_FIELDS["documents"]}
    assert seen == [
        ("/v1/cache/warm", warm),
        ("/v1/cache/unpin", unpin),
        ("/v1/cache/warm", only),
        ("/v1/cache/warm", warm),
        ("/v1/cache/unpin", unpin),
    ]


async def test_a_warm_with_chats_fields_is_what_complete_then_finds_cached() -> None:
    """Against the engine-mode sidecar itself (in process, fake engine, whose tokenizer adds
    a BOS with add_special_tokens): the warmed prefix is the one the chat request hits."""
    from sidecar_fake_engine import FakeEngine

    from prefixcache.sidecar.server.app import SidecarSettings, create_app

    engine = FakeEngine()
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    system = [{"role": "system", "content": "You answer from the documents. " * 4}]
    fields: dict[str, Any] = {"add_special_tokens": True, "documents": [{"text": "blue"}]}
    async with AsyncClient("http://sidecar/v1", transport=transport) as client:
        warm = await client.warm(system, pin=True, **fields)
        question = [*system, {"role": "user", "content": "Colour of the sky?"}]
        out = await client.complete(question, max_tokens=1, **fields)
        assert out.usage.cached_tokens == warm.tokens // engine.block_size * engine.block_size
        assert await client.unpin(system, documents=fields["documents"]) == 0  # not that one
        assert await client.unpin(system, **fields) == warm.pinned_blocks > 0


@BACKENDS
def test_reset_prefix_cache_posts_at_the_root_and_reads_every_servers_answer(
    backend: str,
) -> None:
    seen: list[tuple[str, str, bytes]] = []
    upstreams = [
        {"url": "http://a/v1", "status": 200, "success": True},
        {"url": "http://b/v1", "status": None, "success": False},
    ]
    replies = [
        {"success": True, "evicted_blocks": 7, "pinned_blocks": 2, "in_use_blocks": 0},
        {"success": False, "upstreams": upstreams},  # prefixcache route's
        None,  # an older vLLM: 200, no body
    ]

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), request.content))
        reply = replies[len(seen) - 1]
        return httpx.Response(200, json=reply) if reply is not None else httpx.Response(200)

    async def main() -> None:
        async with _client(handle) as client:
            engine = await client.reset_prefix_cache()
            assert (engine.success, engine.evicted_blocks, engine.pinned_blocks) == (True, 7, 2)
            assert engine.in_use_blocks == 0 and engine.upstreams is None
            router = await client.reset_prefix_cache(reset_external=False)
            assert router.success is False and router.evicted_blocks is None
            assert [(u.url, u.status, u.success) for u in router.upstreams or ()] == [
                ("http://a/v1", 200, True),
                ("http://b/v1", None, False),
            ]
            assert (await client.reset_prefix_cache(reset_external=True)).success is True
        async with AsyncClient("http://h/v1", backend="anthropic") as hosted:
            with pytest.raises(UnsupportedError):
                await hosted.reset_prefix_cache()

    _run(backend, main)
    assert seen == [
        ("POST", "http://sidecar.test/reset_prefix_cache", b""),  # vLLM's place: not under /v1
        ("POST", "http://sidecar.test/reset_prefix_cache?reset_external=false", b""),
        ("POST", "http://sidecar.test/reset_prefix_cache?reset_external=true", b""),
    ]


async def test_reset_prefix_cache_reads_the_sidecars_own_reply() -> None:
    """The typed result against the engine-mode sidecar itself (in process, fake engine)."""
    from sidecar_fake_engine import FakeEngine

    from prefixcache.sidecar.server.app import SidecarSettings, create_app

    engine = FakeEngine()
    await engine.start()
    app = create_app(engine, SidecarSettings(manage_engine=False))
    transport = httpx.ASGITransport(app=app)
    async with AsyncClient("http://sidecar/v1", transport=transport) as client:
        await client.complete([{"role": "user", "content": "cache me " * 8}], max_tokens=1)
        out = await client.reset_prefix_cache(reset_external=False)
    assert out.success is True and out.evicted_blocks and out.evicted_blocks > 0
    assert (out.pinned_blocks, out.in_use_blocks, out.upstreams) == (0, 0, None)


def test_sync_client_shares_the_async_core() -> None:
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        body = json.loads(request.content)
        if calls == 1:
            return _error(429, "busy", "rate_limit_error", **{"Retry-After": "0.05"})
        if body["stream"]:
            return httpx.Response(
                200, content=_chunk("a") + _chunk("b", "stop") + b"data: [DONE]\n\n"
            )
        return httpx.Response(200, json=COMPLETION)

    with Client("http://sidecar.test/v1", transport=httpx.MockTransport(handle)) as client:
        assert client.complete(PROMPT).cache.cached_tokens == 16  # type: ignore[union-attr]
        assert [d.text for d in client.stream(PROMPT)] == ["a", "b"]
    assert calls == 3  # the retry logic is the async client's
