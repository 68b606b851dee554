"""Regression tests of issue 18's HTTP-edge defects: deep JSON nesting, exact salt validation,
half-closed clients. Each failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncGenerator

import httpx
import pytest
from conftest import Server, ServerLoop, health_gaps_while, serve
from sidecar_fake_engine import FakeEngine

from prefixcache.engine.request import EngineRequest, RequestOutput
from prefixcache.sidecar.server.app import SidecarSettings, create_app

USER = {"role": "user", "content": "hello"}


def nested(depth: int, kind: str) -> str:
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("field", ["metadata", "chat_template_kwargs", "user"])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_deep_nesting_is_a_400(fake_server: Server, field: str, kind: str) -> None:
    head = json.dumps({"messages": [USER], "max_tokens": 2})[:-1]
    body = f'{head}, "{field}": {nested(5000, kind)}}}'
    response = httpx.post(f"{fake_server.url}/chat/completions", content=body, timeout=10)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{fake_server.root}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("salt", ["abc\n", "abc\r\n", "\nabc", "ab\nc"])
def test_cache_salt_is_validated_exactly(fake_server: Server, salt: str) -> None:
    body = {"messages": [USER], "max_tokens": 2, "cache_salt": salt}
    response = httpx.post(f"{fake_server.url}/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"
    warm = httpx.post(f"{fake_server.root}/v1/cache/warm", json=body, timeout=10)
    assert warm.status_code == 400, warm.text
    ok = httpx.post(
        f"{fake_server.url}/chat/completions", json={**body, "cache_salt": "abc"}, timeout=10
    )
    assert ok.status_code == 200, ok.text


def half_closed_exchange(root: str, path: str, body: bytes, timeout: float = 20) -> bytes:
    """Send one request, shut the write side (SHUT_WR), read until the server closes."""
    host, port = root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"  # the server's probe: is the client still there
    return received.removeprefix(interim)


@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_client_gets_its_full_response(fake_server: Server, stream: bool) -> None:
    body = json.dumps({"messages": [USER], "max_tokens": 8, "stream": stream}).encode()
    raw = half_closed_exchange(fake_server.root, "/v1/chat/completions", body)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    if stream:
        assert b"data: [DONE]" in raw and raw.endswith(b"0\r\n\r\n"), raw[-200:]
    else:
        payload = raw.split(b"\r\n\r\n", 1)[1]
        assert json.loads(payload)["choices"][0]["finish_reason"] in ("stop", "length")


def test_half_closed_client_on_the_real_engine(sidecar_server: Server) -> None:
    body = json.dumps({"messages": [USER], "max_tokens": 6, "temperature": 0}).encode()
    raw = half_closed_exchange(sidecar_server.root, "/v1/chat/completions", body, timeout=60)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    payload = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert payload["usage"]["completion_tokens"] >= 1


class HeldEngine(FakeEngine):
    """A fake engine whose requests wait (queued, say) until ``release``; it notes which of
    them were closed, as a disconnect closes them (an abort)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.held: list[str] = []
        self.closed: list[str] = []

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        self.held.append(request.request_id)
        try:
            await self.release.wait()
            async for out in super().generate(request):
                yield out
        finally:
            self.closed.append(request.request_id)


def test_a_stream_whose_client_left_while_queued_is_aborted_before_its_first_token(
    server_loop: ServerLoop,
) -> None:
    """An event stream's headers go out before its request is even queued, so a client that
    closes then is not a half close to wait out: the server's SSE comment meets its reset and
    the request is aborted while still queued (before, it ran its prefill first)."""
    engine = HeldEngine()
    server_loop.run(engine.start())
    server = serve(server_loop, create_app(engine, SidecarSettings(manage_engine=False)))
    try:
        host, port = server.root.removeprefix("http://").split(":")
        body = json.dumps({"messages": [USER], "max_tokens": 4, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the stream has started
            deadline = time.monotonic() + 10
            while not engine.held and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.held, "the request never reached the engine"
        deadline = time.monotonic() + 10  # closed (a full close): the reset tells
        while not engine.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.closed == engine.held
    finally:
        server_loop.loop.call_soon_threadsafe(engine.release.set)
        server.stop()


def test_a_half_closed_stream_reader_skips_the_probe(fake_server: Server) -> None:
    """The SSE comment is harmless to a client that only half closed: its stream is whole."""
    body = json.dumps({"messages": [USER], "max_tokens": 8, "stream": True}).encode()
    raw = half_closed_exchange(fake_server.root, "/v1/chat/completions", body)
    events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) > 2


def test_health_reports_an_engine_that_broke_after_serving(fake_server: Server) -> None:
    engine = fake_server.app.state.sidecar.engine
    assert httpx.get(f"{fake_server.root}/health", timeout=5).status_code == 200
    engine.error = "the model step failed: RuntimeError: CUDA error"
    try:
        response = httpx.get(f"{fake_server.root}/health", timeout=5)
        assert response.status_code == 503
        assert response.json() == {"status": "failed", "error": engine.error}
    finally:
        engine.error = None
    assert httpx.get(f"{fake_server.root}/health", timeout=5).status_code == 200


@pytest.mark.timeout(180)
def test_extreme_sampling_values_harm_no_bystander(sidecar_server: Server) -> None:
    """8 greedy bystanders and 6 requests with overflowing values, all at once: every one
    answers 200 and the bystanders' text is what it is alone."""
    import asyncio

    def body(i: int, **fields: object) -> dict:
        msg = {"role": "user", "content": f"bystander {i} tells a story"}
        return {"messages": [msg], "max_tokens": 6, "temperature": 0, **fields}

    extreme = [
        {"temperature": 1e-300},
        {"temperature": 1e-40},
        {"temperature": 1, "top_p": 1e-46},
        {"temperature": 1, "top_p": 5e-324},
        {"temperature": 1, "repetition_penalty": 1e-300},
        {"repetition_penalty": 1e-300},
    ]

    async def run(bodies: list[dict]) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=sidecar_server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/chat/completions", json=b) for b in bodies))

    alone = [
        r.json()["choices"][0]["message"]["content"]
        for r in asyncio.run(run([body(i) for i in range(8)]))
    ]
    mixed = asyncio.run(run([*(body(i) for i in range(8)), *(body(9, **f) for f in extreme)]))
    assert [r.status_code for r in mixed] == [200] * len(mixed), [r.text for r in mixed]
    assert [r.json()["choices"][0]["message"]["content"] for r in mixed[:8]] == alone


def test_a_client_that_leaves_a_plain_request_still_aborts_it(sidecar_server: Server) -> None:
    """A full close is not taken for a half close: the server's probe meets a reset."""
    body = {"messages": [USER], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    before = generated_tokens(sidecar_server.root)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{sidecar_server.url}/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3)
        )
    from conftest import wait_for_idle_blocks

    # Counted, not timed: a fixed few seconds for the blocks to free told an abort from a
    # finished run only on an idle machine. The wait bounds a hang; the token count tells.
    stats = wait_for_idle_blocks(sidecar_server.root, timeout=120)
    assert stats["blocks"]["in_use"] == 0
    ran = generated_tokens(sidecar_server.root) - before
    assert ran < 900, "not aborted: the request ran for all its 900 tokens"


def generated_tokens(root: str) -> float:
    """The engine's generated-token counter, from the sidecar's /metrics."""
    for line in httpx.get(f"{root}/metrics", timeout=30).text.splitlines():
        if line.startswith("prefixcache:generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no prefixcache:generation_tokens_total in /metrics")


# --- slow clients -----------------------------------------------------------------------------


@pytest.fixture
def quick_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixcache.sidecar.http import uvicorn_protocol

    assert uvicorn_protocol._DEADLINES  # uvicorn[standard]'s httptools parser is what runs
    monkeypatch.setattr(uvicorn_protocol, "HEADERS_TIMEOUT_S", 0.5)
    monkeypatch.setattr(uvicorn_protocol, "BODY_TIMEOUT_S", 0.5)


def closed_by_server_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes ``sock`` (EOF or reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("send", ["nothing", "half the headers", "half the body"])
def test_a_slow_client_is_dropped_and_others_are_served(
    fake_server: Server, quick_deadlines: None, send: str
) -> None:
    """A connection that never sends a byte, trickles its headers or stalls in its body is
    closed (uvicorn held them for as long as the client liked: enough of them used up the
    process's file descriptors)."""
    host, port = fake_server.root.removeprefix("http://").split(":")
    body = json.dumps({"messages": [USER], "max_tokens": 2}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if send == "half the headers":
            sock.sendall(head[:20])
        elif send == "half the body":
            sock.sendall(head + body[:5])
        assert closed_by_server_within(sock, 5.0)
    answer = httpx.post(f"{fake_server.url}/chat/completions", content=body, timeout=10)
    assert answer.status_code == 200


def test_deadlines_never_cut_a_long_answer_or_a_kept_alive_connection(
    server_loop: ServerLoop, quick_deadlines: None
) -> None:
    from sidecar_fake_engine import FakeEngine

    from prefixcache.sidecar.server.app import SidecarSettings, create_app

    server = serve(server_loop, create_app(FakeEngine(delay=0.1), SidecarSettings()))
    try:
        with httpx.Client(timeout=30) as client:  # one kept-alive connection
            body = {"messages": [USER], "max_tokens": 15, "stream": True}
            with client.stream("POST", f"{server.url}/chat/completions", json=body) as reply:
                lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 15  # 1.5 s of tokens
            time.sleep(0.3)  # idle, under uvicorn's keep-alive
            again = client.post(f"{server.url}/chat/completions", json={**body, "stream": False})
            assert again.status_code == 200
    finally:
        server.stop()


def test_long_id_lists_are_listed_and_decoded_off_the_event_loop(
    server_loop: ServerLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/detokenize of 600K ids held the event loop 175 ms (/tokenize's token strings alike):
    from LONG_IDS on, a worker thread decodes (here a decode made to take 1.5 s)."""
    from sidecar_fake_engine import OFFSET, FakeEngine

    from prefixcache.sidecar.server.app import SidecarSettings, create_app
    from prefixcache.sidecar.server.tokenize_routes import LONG_IDS

    engine = FakeEngine()
    fake_server = serve(server_loop, create_app(engine, SidecarSettings()))
    tokenizer = engine.tokenizer
    decode = tokenizer.decode

    def slow(ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) >= LONG_IDS:
            time.sleep(1.5)  # blocks whatever thread runs it
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", slow)
    result: list[httpx.Response] = []
    body = {"tokens": [OFFSET + ord("a")] * LONG_IDS}
    gaps = health_gaps_while(
        fake_server.root,
        lambda: result.append(httpx.post(f"{fake_server.root}/detokenize", json=body, timeout=30)),
    )
    fake_server.stop()
    assert result[0].status_code == 200 and len(gaps) >= 5
    assert max(gaps) < 0.75, gaps
