"""Edges of the HTTP exchange: a stream whose body ends before its last chunk, per-call
``Timeouts`` (every field, connect included), and error bodies without a message."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest

from prefixcache.sdk import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    InternalServerError,
    Prompt,
    Timeouts,
)

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
PROMPT = Prompt.builder().static("Be brief.", tag="rules").dynamic("Hello?", tag="q").build()
SLOW = Timeouts(connect=30, first_token=30, total=30)  # the client's own: never reached here
Handler = Callable[[httpx.Request], Awaitable[httpx.Response] | httpx.Response]


def _chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {"role": "assistant"} if content is None else {"content": content}
    body = {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": delta}]}
    body["choices"][0]["finish_reason"] = finish
    return f"data: {json.dumps(body)}\n\n"


def _event(type_: str, **fields: Any) -> str:
    return f"event: {type_}\ndata: {json.dumps({'type': type_, **fields})}\n\n"


def _sse(text: str) -> httpx.Response:
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def _client(handler: Handler, **kwargs: Any) -> AsyncClient:
    transport = httpx.MockTransport(handler)
    return AsyncClient("http://sidecar.test/v1", transport=transport, max_retries=0, **kwargs)


# --- a stream cut between chunks -----------------------------------------------------------

CUT_STREAMS = {
    "after text": _chunk() + _chunk("hi"),
    "without a final blank line": _chunk() + _chunk("hi").rstrip("\n"),
    "before any event": "",
    "keep-alive only": ": ping\n\n",
}


@BACKENDS
@pytest.mark.parametrize("body", CUT_STREAMS.values(), ids=CUT_STREAMS.keys())
def test_a_stream_that_ends_before_its_last_chunk_raises(backend: str, body: str) -> None:
    async def main() -> None:
        async with _client(lambda request: _sse(body)) as client:
            stream = client.stream(PROMPT)
            with pytest.raises(APIConnectionError, match="ended before its last chunk"):
                async for _ in stream:
                    pass
            assert stream.finish_reason is None
            assert client.cache_report().requests == 0  # not recorded as a finished request

    anyio.run(main, backend=backend)


def test_an_anthropic_stream_cut_before_message_delta_raises() -> None:
    start = {"id": "msg_1", "model": "claude", "usage": {"input_tokens": 5, "output_tokens": 0}}
    text = _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "hi"})

    async def main() -> None:
        body = _event("message_start", message=start) + text
        async with _client(lambda request: _sse(body), backend="anthropic") as client:
            with pytest.raises(APIConnectionError, match="ended before its last chunk"):
                async for _ in client.stream(PROMPT, max_tokens=8):
                    pass

    anyio.run(main)


COMPLETE_STREAMS = {
    "with [DONE]": _chunk() + _chunk("hi") + "data: [DONE]\n\n",
    "finish_reason, no [DONE]": _chunk() + _chunk("hi", "stop"),
    "[DONE] with no finish_reason": _chunk("hi") + "data: [DONE]\n\n",
}


@pytest.mark.parametrize("body", COMPLETE_STREAMS.values(), ids=COMPLETE_STREAMS.keys())
def test_a_stream_that_says_it_ended_ends_quietly(body: str) -> None:
    async def main() -> None:
        async with _client(lambda request: _sse(body)) as client:
            assert [d.text async for d in client.stream(PROMPT)][-1] == "hi"

    anyio.run(main)


# --- per-call Timeouts ---------------------------------------------------------------------


async def _connect_as_httpcore_does(request: httpx.Request) -> httpx.Response:
    """A server that never accepts: the connect limit httpx was given runs out."""
    limit = request.extensions["timeout"]["connect"]
    await anyio.sleep(limit)
    raise httpx.ConnectTimeout("timed out connecting", request=request)


@BACKENDS
@pytest.mark.parametrize("call", ["complete", "stream"])
def test_a_per_call_connect_timeout_is_what_httpx_gets(backend: str, call: str) -> None:
    async def main() -> None:
        async with _client(_connect_as_httpcore_does, timeouts=SLOW) as client:
            start = time.monotonic()
            with pytest.raises(APITimeoutError) as info:
                if call == "complete":
                    await client.complete(PROMPT, timeouts=Timeouts(connect=0.05))
                else:
                    async for _ in client.stream(PROMPT, timeouts=Timeouts(connect=0.05)):
                        pass
            assert info.value.kind == "connect"
            assert time.monotonic() - start < 5

    anyio.run(main, backend=backend)


def test_httpx_gets_every_limit_from_the_per_call_timeouts() -> None:
    seen: list[dict[str, float | None]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        if request.url.path.endswith("models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if json.loads(request.content)["stream"]:
            return _sse(_chunk("hi", "stop"))
        message = {"role": "assistant", "content": "hi"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return httpx.Response(200, json={"id": "c1", "model": "m", "choices": [choice]})

    async def main() -> None:
        async with _client(handle, timeouts=SLOW) as client:
            await client.complete(PROMPT, timeouts=Timeouts(connect=1.5))
            async for _ in client.stream(PROMPT, timeouts=Timeouts(connect=2.5)):
                pass
            await client.models()  # no per-call timeouts: the client's

    anyio.run(main)
    assert seen == [
        {"connect": 1.5, "read": None, "write": 1.5, "pool": 1.5},
        {"connect": 2.5, "read": None, "write": 2.5, "pool": 2.5},
        {"connect": 30, "read": None, "write": 30, "pool": 30},
    ]


@pytest.mark.parametrize(
    ("call", "timeouts", "kind"),
    [
        ("complete", Timeouts(total=0.1), "total"),
        ("stream", Timeouts(first_token=0.1), "first_token"),
        ("stream", Timeouts(total=0.1), "total"),
    ],
)
def test_per_call_deadlines_override_the_clients(call: str, timeouts: Timeouts, kind: str) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(30)
        raise AssertionError("not reached")

    async def main() -> None:
        async with _client(handle, timeouts=SLOW) as client:
            with pytest.raises(APITimeoutError) as info:
                if call == "complete":
                    await client.complete(PROMPT, timeouts=timeouts)
                else:
                    async for _ in client.stream(PROMPT, timeouts=timeouts):
                        pass
            assert info.value.kind == kind

    anyio.run(main)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [(httpx.WriteTimeout, "write"), (httpx.PoolTimeout, "pool"), (httpx.ReadTimeout, "read")],
)
def test_httpx_timeouts_map_to_documented_kinds(
    exc: type[httpx.TimeoutException], kind: str
) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        raise exc("timed out", request=request)

    async def main() -> None:
        async with _client(handle) as client:
            with pytest.raises(APITimeoutError) as info:
                await client.complete(PROMPT)
            assert info.value.kind == kind

    anyio.run(main)


# --- error bodies --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "cls", "message"),
    [
        (
            httpx.Response(400, json={"error": {"code": "bad_thing", "type": "invalid"}}),
            BadRequestError,
            '{"error":{"code":"bad_thing","type":"invalid"}}',  # the body text
        ),
        (httpx.Response(500, json={"error": {"message": None}}), InternalServerError, None),
        (httpx.Response(400, json={"detail": [{"loc": ["x"]}]}), BadRequestError, None),
    ],
    ids=["no message", "null message", "detail list"],
)
def test_an_error_without_a_message_falls_back_to_the_body(
    response: httpx.Response, cls: type[Exception], message: str | None
) -> None:
    async def main() -> None:
        async with _client(lambda request: response) as client:
            with pytest.raises(cls) as info:
                await client.complete(PROMPT)
        got = info.value.message  # type: ignore[attr-defined]
        assert got != "null" and got
        if message is not None:
            assert got == message
        if response.status_code == 500:
            assert got == response.text  # '{"error":{"message":null}}'

    anyio.run(main)


def test_an_empty_error_body_gives_the_reason_phrase() -> None:
    async def main() -> None:
        async with _client(lambda request: httpx.Response(400)) as client:
            with pytest.raises(BadRequestError) as info:
                await client.complete(PROMPT)
        assert info.value.message == "Bad Request"

    anyio.run(main)
