"""Upstream mode: routing policy on its own, then the sidecar over real HTTP in front of three
fake OpenAI-compatible upstreams, all on loopback."""

from __future__ import annotations

import asyncio
import math
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from conftest import Server, ServerLoop, serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from prefixcache.sidecar.http.streaming import DONE, SSEResponse, sse_event
from prefixcache.sidecar.http.tenancy import KeyStore
from prefixcache.sidecar.router.app import UpstreamSettings, create_upstream_app
from prefixcache.sidecar.router.pool import (
    PROMPT_KEY_CHARS,
    PROMPT_KEY_TOKENS,
    Choice,
    UpstreamPool,
    affinity_key,
)

SYSTEM = "You are the help desk of a railway company. Answer in one sentence. " * 8

# --- fake upstreams -------------------------------------------------------------------------


def stream_frames(name: str, count: int) -> list[bytes]:
    """The SSE frames a fake upstream streams, [DONE] excluded."""
    frames = []
    for i in range(count):
        last = i == count - 1
        choice = {
            "index": 0,
            "delta": {"content": f"{name}-{i} "},
            "finish_reason": "stop" if last else None,
        }
        chunk = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": name,
            "choices": [choice],
        }
        frames.append(sse_event(chunk))
    return frames


@dataclass(slots=True)
class FakeUpstream:
    """Records what reached it. A request's ``x_fake`` field steers the answer:
    delay (s), status (an error answer), chunks and chunk_delay (s) of a stream, and
    drop_after (frames sent before the connection is dropped; with half_frame, half of the
    next one is sent first)."""

    name: str
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    stream_cut: threading.Event = field(default_factory=threading.Event)
    health_status: int = 200
    reset_reply: tuple[int, bytes] = (200, b'{"success": true}')  # its /reset_prefix_cache's
    resets: list[tuple[str, bytes, str | None]] = field(default_factory=list)  # query, body, key

    def reset(self) -> None:
        self.health_status = 200
        self.bodies.clear()
        self.headers.clear()
        self.stream_cut.clear()
        self.reset_reply = (200, b'{"success": true}')
        self.resets.clear()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            ]
        )

    async def reset_prefix_cache(self, request: Request) -> Response:  # vLLM's, at the root
        key = request.headers.get("authorization")
        self.resets.append((request.url.query, await request.body(), key))
        status, content = self.reset_reply
        return Response(content, status, media_type="application/json")

    async def tokenize(self, request: Request) -> Response:  # vLLM's, at the root
        body = await request.json()
        self.bodies.append(body)
        return JSONResponse({"count": 1, "max_model_len": 8, "tokens": [len(body["prompt"])]})

    async def tokenizer_info(self, request: Request) -> Response:  # vLLM's, at the root
        return JSONResponse({"eos_token": "</s>", "method": request.method})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"}, self.health_status)

    async def models(self, request: Request) -> Response:
        card = {"id": self.name, "object": "model", "created": 0, "owned_by": "fake"}
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(self, request: Request) -> Response | SSEResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        fake = body.get("x_fake", {})
        await asyncio.sleep(fake.get("delay", 0))
        if "status" in fake:
            error = {"message": f"{self.name} refuses", "type": "BadRequestError", "code": 400}
            return JSONResponse({"error": error}, fake["status"])
        if body.get("stream"):
            return SSEResponse(self._stream(fake))
        if "prompt" in body:
            choice = {"index": 0, "text": f"from {self.name}", "finish_reason": "stop"}
            return JSONResponse(self._completion("text_completion", choice))
        message = {"role": "assistant", "content": f"answer from {self.name}"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return JSONResponse(self._completion("chat.completion", choice))

    def _completion(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
        return {
            "id": "fake-1",
            "object": kind,
            "created": 0,
            "model": self.name,
            "choices": [choice],
            "usage": usage,
        }

    async def _stream(self, fake: dict[str, Any]) -> AsyncIterator[bytes]:
        frames = stream_frames(self.name, fake.get("chunks", 3))
        finished = False
        try:
            for i, frame in enumerate(frames):
                if i == fake.get("drop_after"):
                    if fake.get("half_frame"):
                        yield frame[: len(frame) // 2]
                        await asyncio.sleep(0.05)  # let the half reach the sidecar alone
                    raise RuntimeError("the fake upstream drops the connection")
                if i:
                    await asyncio.sleep(fake.get("chunk_delay", 0))
                yield frame
            yield DONE
            finished = True
        finally:
            if not finished:
                self.stream_cut.set()


def closed_url() -> str:
    """A loopback URL where nothing listens: connecting is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def chat(system: str | None, *turns: str, **fields: Any) -> dict[str, Any]:
    """A chat body; turns alternate user, assistant, user, ..."""
    messages = [{"role": "system", "content": system}] if system else []
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return {"model": "m", "messages": messages, **fields}


def metric(root: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{root}/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(r"(\S+?)(?:\{(.*)\})? (\S+)", line)
        if match and match[1] == name and ",".join(sorted((match[2] or "").split(","))) == wanted:
            return float(match[3])
    raise AssertionError(f"{name}{{{wanted}}} not in /metrics")


def wait_until_idle(sidecar: Server, timeout: float = 30) -> None:
    """Until no upstream has a request in flight; the timeout bounds a hang (a leaked count)."""
    pool = sidecar.app.state.upstream.pool
    deadline = time.monotonic() + timeout
    while any(u.in_flight for u in pool.upstreams):
        assert time.monotonic() < deadline, [u.in_flight for u in pool.upstreams]
        time.sleep(0.02)


@pytest.fixture(scope="module")
def fakes(server_loop: ServerLoop) -> Iterator[list[FakeUpstream]]:
    fakes = [FakeUpstream(f"up{i}") for i in range(3)]
    servers = [serve(server_loop, fake.app()) for fake in fakes]
    for fake, server in zip(fakes, servers, strict=True):
        fake.url = server.url
    yield fakes
    for server in servers:
        server.stop()


@pytest.fixture
def start_sidecar(
    server_loop: ServerLoop, fakes: list[FakeUpstream]
) -> Iterator[Callable[..., Server]]:
    for fake in fakes:
        fake.reset()
    started: list[Server] = []

    def start(urls: list[str], **options: Any) -> Server:
        options.setdefault("routing", "hash")  # these tests pin the hash policy down
        settings = UpstreamSettings(tuple(urls), **options)
        server = serve(server_loop, create_upstream_app(settings), health=False)
        started.append(server)
        return server

    yield start
    for server in started:
        wait_until_idle(server)  # every in-flight count was released
        server.stop()


@pytest.fixture
def sidecar(start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]) -> Server:
    return start_sidecar([fake.url for fake in fakes])


# --- the affinity key -----------------------------------------------------------------------


def test_requests_sharing_a_system_prompt_share_a_key() -> None:
    key = affinity_key(chat(SYSTEM, "When does the 8:15 leave?"))
    assert affinity_key(chat(SYSTEM, "Is there a bike carriage?")) == key
    assert affinity_key(chat(SYSTEM + "!", "When does the 8:15 leave?")) != key
    assert affinity_key({**chat(SYSTEM, "x"), "model": "other"}) != key
    developer = chat(None, "When does the 8:15 leave?")
    developer["messages"].insert(0, {"role": "developer", "content": SYSTEM})
    assert affinity_key(developer) != affinity_key(chat(None, "When does the 8:15 leave?"))
    other_question = {**developer, "messages": [developer["messages"][0], {"role": "user"}]}
    assert affinity_key(other_question) == affinity_key(developer)


def test_a_conversation_keeps_its_key_from_turn_to_turn() -> None:
    turn1 = chat(None, "Plan a trip to Lyon.")
    turn2 = chat(None, "Plan a trip to Lyon.", "Take the TGV.", "And back on Sunday?")
    assert affinity_key(turn2) == affinity_key(turn1)
    assert affinity_key(chat(None, "Plan a trip to Nice.")) != affinity_key(turn1)


def test_segment_key_is_the_stable_part_in_stability_order() -> None:
    def body(*segments: tuple[str, str, str]) -> dict[str, Any]:
        segs = [
            {"role": role, "content": content, "tag": f"t{i}", "stability": stability}
            for i, (role, content, stability) in enumerate(segments)
        ]
        return {"model": "m", "messages": [], "segments": segs}

    rules = ("system", SYSTEM, "static")
    doc = ("user", "Timetable: ...", "shared")
    history = ("user", "Hi, I need a ticket.", "session")
    question = ("user", "How much?", "dynamic")
    key = affinity_key(body(rules, doc, question))
    assert affinity_key(body(question, doc, rules)) == key  # stability order, not declared
    assert affinity_key(body(rules, doc, history, ("user", "Other?", "dynamic"))) == key
    assert affinity_key(body(doc, rules)) == key
    assert affinity_key(body(rules, question)) != key
    # A static system segment keys like the equal system message.
    assert affinity_key(body(rules, question)) == affinity_key(chat(SYSTEM, "anything"))
    # Without static or shared segments, the conversation's first session segment counts.
    later = ("assistant", "Where to?", "session")
    assert affinity_key(body(history, later, question)) == affinity_key(body(history, question))
    assert affinity_key(body(history)) != affinity_key(body(("user", "Hello", "session")))


def test_completion_key_is_the_head_of_the_prompt() -> None:
    head = "x" * PROMPT_KEY_CHARS
    key = affinity_key({"model": "m", "prompt": head + "tail one"})
    assert affinity_key({"model": "m", "prompt": head + "tail two"}) == key
    assert affinity_key({"model": "m", "prompt": [head + "batch of one"]}) == key
    assert affinity_key({"model": "m", "prompt": "y" + head}) != key
    ids = list(range(PROMPT_KEY_TOKENS))
    key = affinity_key({"model": "m", "prompt": [*ids, 1, 2]})
    assert affinity_key({"model": "m", "prompt": [[*ids, 3]]}) == key
    assert affinity_key({"model": "m", "prompt": [1, *ids]}) != key


def test_odd_bodies_still_get_a_key() -> None:
    for body in (
        {},
        {"messages": "not a list"},
        {"messages": [1, None]},
        {"segments": [1, {"stability": ["x"]}], "messages": []},
        {"prompt": {"a": 1}},
    ):
        assert len(affinity_key(body)) == 32


# --- the pool -------------------------------------------------------------------------------


URLS = ["http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"]


def test_rendezvous_spreads_keys_and_a_new_upstream_only_takes_keys() -> None:
    keys = [f"key {i}".encode() for i in range(300)]
    three = UpstreamPool(URLS)
    four = UpstreamPool([*URLS, "http://d:8000/v1"])
    owners3 = [three.choose(k).upstream.url for k in keys]  # type: ignore[union-attr]
    owners4 = [four.choose(k).upstream.url for k in keys]  # type: ignore[union-attr]
    assert all(count > 60 for count in Counter(owners3).values()) and len(set(owners3)) == 3
    moved = [(a, b) for a, b in zip(owners3, owners4, strict=True) if a != b]
    assert moved and all(b == "http://d:8000/v1" for _, b in moved)


def test_a_light_load_stays_with_the_owner() -> None:
    """Below min_load in flight the owner takes every request of its key: batching a few more
    costs a replica little, a prefix recomputed elsewhere costs a prefill."""
    pool = UpstreamPool(URLS, min_load=8)
    choices = []
    for _ in range(9):
        choice = pool.choose(b"k")
        assert choice is not None
        pool.acquire(choice.upstream)
        choices.append(choice)
    assert [c.route for c in choices] == ["affinity"] * 8 + ["overflow"]
    assert len({id(c.upstream) for c in choices[:8]}) == 1


def test_the_owner_is_left_at_its_load_bound() -> None:
    pool = UpstreamPool(URLS, load_factor=1.25, min_load=1)
    first = pool.choose(b"k")
    assert first is not None and first.route == "affinity"
    owner = first.upstream
    routes = []
    for in_flight in range(12):
        choice = pool.choose(b"k")
        assert choice is not None
        routes.append(choice.route)
        pool.acquire(choice.upstream)
        assert choice.upstream.in_flight <= math.ceil(1.25 * (in_flight + 1) / 3)
    assert owner.in_flight == max(u.in_flight for u in pool.upstreams) <= 5
    assert "overflow" in routes and routes[0] == "affinity"
    for upstream in pool.upstreams:
        while upstream.in_flight:
            pool.release(upstream)
    with pytest.raises(RuntimeError):
        pool.release(owner)


def test_a_down_upstream_is_skipped_until_retry_after() -> None:
    now = [100.0]
    pool = UpstreamPool(URLS, retry_after_s=5.0, clock=lambda: now[0])
    owner = pool.choose(b"k").upstream  # type: ignore[union-attr]
    pool.mark_down(owner)
    choice = pool.choose(b"k")
    assert choice is not None and choice.upstream is not owner and choice.route == "failover"
    assert owner not in pool.healthy() and not pool.is_healthy(owner)
    assert pool.choose(b"k", exclude={u.url for u in pool.healthy()}) is None
    now[0] += 5.0
    assert pool.choose(b"k") == Choice(owner, "affinity")


def test_pool_refuses_a_bad_configuration() -> None:
    for urls, options in (
        ([], {}),
        (["http://a/v1", "http://a/v1/"], {}),
        (["a:8000/v1"], {}),
        (URLS, {"load_factor": 0.9}),
        (URLS, {"retry_after_s": -1}),
    ):
        with pytest.raises(ValueError):
            UpstreamPool(urls, **options)


# --- routing over HTTP ----------------------------------------------------------------------


async def test_one_system_prompt_sticks_and_many_spread(
    sidecar: Server, fakes: list[FakeUpstream]
) -> None:
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        same = [
            (await client.post("/chat/completions", json=chat(SYSTEM, f"Question {i}?"))).json()
            for i in range(20)
        ]
        assert len({answer["model"] for answer in same}) == 1
        spread = [
            (await client.post("/chat/completions", json=chat(f"{i} {SYSTEM}", "Hi"))).json()
            for i in range(30)
        ]
        assert {answer["model"] for answer in spread} == {"up0", "up1", "up2"}
    owner = next(fake for fake in fakes if fake.name == same[0]["model"])
    assert sum("Question" in b["messages"][1]["content"] for b in owner.bodies) == 20
    # One at a time, nothing is over the load bound: every request went to its key's owner.
    for route, count in (("affinity", 50), ("overflow", 0), ("failover", 0)):
        assert routed(sidecar, route) == count


def routed(sidecar: Server, route: str) -> float:
    """Requests the sidecar sent upstream for this route reason, over all upstreams."""
    return sum(
        metric(sidecar.root, "prefixcache:upstream_requests_total", upstream=u.url, route=route)
        for u in sidecar.app.state.upstream.pool.upstreams
    )


async def test_turn_two_lands_where_turn_one_did(sidecar: Server) -> None:
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        placements = []
        for i in range(12):
            opening = f"Conversation {i}: plan a trip."
            turn1 = await client.post("/chat/completions", json=chat(None, opening))
            body = chat(None, opening, turn1.json()["choices"][0]["message"]["content"], "More?")
            turn2 = await client.post("/chat/completions", json=body)
            assert turn2.json()["model"] == turn1.json()["model"]
            placements.append(turn1.json()["model"])
        assert len(set(placements)) > 1  # conversations without a system prompt still spread


async def test_concurrent_requests_for_one_key_respect_the_load_bound(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    sidecar = start_sidecar([fake.url for fake in fakes], min_load=1)
    # each held 3 s upstream, so all 12 are in flight together even when sending them is slow
    body = chat(SYSTEM, "slow one", x_fake={"delay": 3})
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        answers = await asyncio.gather(
            *(client.post("/chat/completions", json=body) for _ in range(12))
        )
    placed = Counter(answer.json()["model"] for answer in answers)
    assert len(placed) >= 2 and max(placed.values()) <= 5  # ceil(1.25 * 12 / 3)
    assert routed(sidecar, "overflow") >= 1 and routed(sidecar, "failover") == 0


# --- failover -------------------------------------------------------------------------------


async def test_a_dead_upstream_is_failed_over(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    dead = closed_url()
    sidecar = start_sidecar([dead, fakes[0].url, fakes[1].url], retry_after_s=60)
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        answers = [
            await client.post("/chat/completions", json=chat(f"{i} {SYSTEM}", "Hi"))
            for i in range(30)
        ]
        assert all(answer.status_code == 200 for answer in answers)
        assert {answer.json()["model"] for answer in answers} == {"up0", "up1"}
        assert (await client.get(f"{sidecar.root}/health")).json() == {"status": "ok"}
    # one for the first request, one for /health's probe (it asks down upstreams too)
    assert metric(sidecar.root, "prefixcache:upstream_connect_failures_total", upstream=dead) == 2
    assert metric(sidecar.root, "prefixcache:upstream_healthy", upstream=dead) == 0
    failovers = sum(
        metric(sidecar.root, "prefixcache:upstream_requests_total", upstream=url, route="failover")
        for url in (fakes[0].url, fakes[1].url)
    )
    assert failovers >= 2  # the first one found it dead; the later ones skip it
    assert not fakes[2].bodies


async def test_no_reachable_upstream_is_a_502_and_health_503(
    start_sidecar: Callable[..., Server],
) -> None:
    dead = [closed_url(), closed_url()]
    sidecar = start_sidecar(dead, retry_after_s=60)
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        answer = await client.post("/chat/completions", json=chat(SYSTEM, "Hi"))
        assert answer.status_code == 502
        assert answer.json()["error"]["message"] == "no upstream reachable"
        assert answer.json()["error"]["type"] == "server_error"
        assert answer.headers["retry-after"] == "60"
        for url in dead:
            assert metric(sidecar.root, "prefixcache:upstream_connect_failures_total", upstream=url)
        health = await client.get(f"{sidecar.root}/health")
        assert health.status_code == 503
        models = await client.get("/models")
        assert models.status_code == 502  # nothing is tried while every upstream is down


async def test_health_asks_the_upstreams_before_any_request_fails(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    dead = [closed_url(), closed_url()]
    sidecar = start_sidecar(dead, retry_after_s=60)
    assert httpx.get(f"{sidecar.root}/health").status_code == 503  # no request was sent
    for url in dead:
        assert metric(sidecar.root, "prefixcache:upstream_connect_failures_total", upstream=url)

    mixed = start_sidecar([dead[0], fakes[0].url], retry_after_s=60)
    assert httpx.get(f"{mixed.root}/health").status_code == 200
    pool = mixed.app.state.upstream.pool
    assert [pool.is_healthy(u) for u in pool.upstreams] == [False, True]


async def test_an_upstream_whose_health_fails_is_skipped_until_it_recovers(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    fakes[0].health_status = 503  # e.g. still loading its cache
    sidecar = start_sidecar([fakes[0].url], retry_after_s=60)
    assert httpx.get(f"{sidecar.root}/health").status_code == 503
    assert httpx.post(f"{sidecar.url}/chat/completions", json=chat(SYSTEM, "x")).status_code == 502
    assert not fakes[0].bodies
    fakes[0].health_status = 200
    await asyncio.sleep(1.1)  # past the probe's interval, far inside the 60 s mark
    assert httpx.get(f"{sidecar.root}/health").status_code == 200
    answer = httpx.post(f"{sidecar.url}/chat/completions", json=chat(SYSTEM, "x"))
    assert answer.status_code == 200 and len(fakes[0].bodies) == 1


async def test_a_failed_upstream_is_tried_again_after_retry_after(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    dead = closed_url()
    sidecar = start_sidecar([dead], retry_after_s=60)
    now = [1000.0]  # the pool's clock, moved by the test: a loaded box cannot lapse it early
    sidecar.app.state.upstream.pool.clock = lambda: now[0]
    failures = "prefixcache:upstream_connect_failures_total"
    assert httpx.post(f"{sidecar.url}/completions", json={"prompt": "a"}).status_code == 502
    assert metric(sidecar.root, failures, upstream=dead) == 1
    now[0] += 59.9
    assert httpx.post(f"{sidecar.url}/completions", json={"prompt": "a"}).status_code == 502
    assert metric(sidecar.root, failures, upstream=dead) == 1  # not tried before Retry-After
    now[0] += 0.1
    assert httpx.post(f"{sidecar.url}/completions", json={"prompt": "a"}).status_code == 502
    assert metric(sidecar.root, failures, upstream=dead) == 2  # tried again, still dead
    assert httpx.get(f"{sidecar.root}/health").status_code == 503  # and /health asked it too
    assert metric(sidecar.root, failures, upstream=dead) == 3


# --- streaming ------------------------------------------------------------------------------


async def test_a_stream_is_relayed_byte_for_byte(sidecar: Server) -> None:
    body = chat(SYSTEM, "Stream it", stream=True, x_fake={"chunks": 3, "chunk_delay": 0.05})
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", f"{sidecar.url}/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join([chunk async for chunk in response.aiter_raw()])
    owner = received.split(b'"model":"')[1][:3].decode()
    assert received == b"".join(stream_frames(owner, 3)) + DONE
    lines = [line for line in received.decode().split("\n\n") if line]
    assert len(lines) == 4 and lines[-1] == "data: [DONE]"


async def test_a_client_leaving_mid_stream_closes_the_upstream_stream(
    sidecar: Server, fakes: list[FakeUpstream]
) -> None:
    # 2000 chunks: 100 s of stream, so the waits below (hang bounds, generous for a loaded
    # box) end long before the upstream's stream could end by itself.
    body = chat(SYSTEM, "Long one", stream=True, x_fake={"chunks": 2000, "chunk_delay": 0.05})
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", f"{sidecar.url}/chat/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break
    owner = next(fake for fake in fakes if fake.bodies)
    assert await asyncio.to_thread(owner.stream_cut.wait, 30)
    await asyncio.to_thread(wait_until_idle, sidecar, 30)


async def test_an_upstream_dropping_mid_stream_ends_with_an_error_event(sidecar: Server) -> None:
    body = chat(SYSTEM, "Breaks", stream=True, x_fake={"chunks": 3, "drop_after": 2})
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(f"{sidecar.url}/chat/completions", json=body)
    events = [event for event in response.text.split("\n\n") if event]
    assert len(events) == 4 and events[-1] == "data: [DONE]"
    assert '"code":"upstream_disconnected"' in events[2]


# --- what is forwarded ----------------------------------------------------------------------


async def test_segments_are_forwarded_as_messages_in_stability_order(
    sidecar: Server, fakes: list[FakeUpstream]
) -> None:
    segments = [
        {"role": "user", "content": "What now?", "tag": "q", "stability": "dynamic"},
        {"role": "user", "content": "History", "tag": "h", "stability": "session"},
        {"role": "system", "content": "Rules", "tag": "r", "stability": "static"},
        {"role": "user", "content": "Doc A", "tag": "a", "stability": "shared"},
        {"role": "user", "content": "Doc B", "tag": "b", "stability": "shared"},
        {"role": "user", "content": "Default is dynamic", "tag": "d"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"model": "m", "messages": [], "segments": segments, "tools": tools, "top_k": 5}
    answer = httpx.post(f"{sidecar.url}/chat/completions", json=body)
    assert answer.status_code == 200
    [received] = [b for fake in fakes for b in fake.bodies]
    assert received == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Rules"},
            {"role": "user", "content": "Doc A"},
            {"role": "user", "content": "Doc B"},
            {"role": "user", "content": "History"},
            {"role": "user", "content": "What now?"},
            {"role": "user", "content": "Default is dynamic"},
        ],
        "tools": tools,
        "top_k": 5,
    }
    # Routed by the stable part: a different question goes to the same upstream.
    segments[0] = {**segments[0], "content": "And then?"}
    again = httpx.post(f"{sidecar.url}/chat/completions", json={**body, "segments": segments})
    assert again.json()["model"] == answer.json()["model"]


async def test_an_upstream_error_is_passed_through_unchanged(sidecar: Server) -> None:
    body = chat(SYSTEM, "Refuse", x_fake={"status": 400})
    answer = httpx.post(f"{sidecar.url}/chat/completions", json=body)
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/json"
    owner = answer.json()["error"]["message"].split()[0]
    assert answer.content == (
        b'{"error":{"message":"' + owner.encode() + b' refuses","type":"BadRequestError",'
        b'"code":400}}'
    )
    streamed = httpx.post(f"{sidecar.url}/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.content == answer.content


async def test_bad_bodies_are_refused_before_any_upstream(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    sidecar = start_sidecar([fake.url for fake in fakes], max_body_bytes=4096)
    url = f"{sidecar.url}/chat/completions"
    for content, status, code in (
        (b'{"messages": [', 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b"\xff\xfe", 400, "invalid_json"),
        (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "request_too_large"),
        (
            b'{"segments": [{"role": "user", "content": "a", "tag": "t", "stability": "x"}]}',
            400,
            None,
        ),
        (b'{"segments": [], "messages": []}', 400, None),
        (
            b'{"segments": [{"role": "user", "content": "a", "tag": "t"}], "messages": [1]}',
            400,
            None,
        ),
    ):
        answer = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert answer.status_code == status, content
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if code is not None:
            assert error["code"] == code
    assert not any(fake.bodies for fake in fakes)


async def test_completions_are_routed_by_the_head_of_the_prompt(sidecar: Server) -> None:
    head = "Context: " + "rails " * 400
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        answers = [
            (await client.post("/completions", json={"prompt": head + str(i)})).json()
            for i in range(8)
        ]
    assert len({answer["model"] for answer in answers}) == 1
    assert answers[0]["object"] == "text_completion"


async def test_keys_guard_the_sidecar_and_upstreams_get_their_own_key(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    keys = KeyStore([("sk-client-key-001", "acme", False)])
    sidecar = start_sidecar([fakes[0].url], keys=keys, upstream_api_key="sk-upstream")
    url = f"{sidecar.url}/chat/completions"
    assert httpx.post(url, json=chat(SYSTEM, "Hi")).status_code == 401
    assert httpx.get(f"{sidecar.url}/models").status_code == 401
    bad = httpx.post(url, json=chat(SYSTEM, "Hi"), headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    auth = {"authorization": "Bearer sk-client-key-001"}
    assert httpx.post(url, json=chat(SYSTEM, "Hi"), headers=auth).status_code == 200
    assert not any(fake.bodies for fake in fakes[1:])
    assert [h["authorization"] for h in fakes[0].headers] == ["Bearer sk-upstream"]


async def test_models_come_from_the_first_healthy_upstream(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    sidecar = start_sidecar([closed_url(), fakes[2].url, fakes[0].url])
    models = httpx.get(f"{sidecar.url}/models")
    assert models.status_code == 200
    assert [card["id"] for card in models.json()["data"]] == ["up2"]
    one = httpx.get(f"{sidecar.url}/models/up2")  # the fake has no such route: its 404
    assert one.status_code == 404 and one.text == "Not Found"
    assert httpx.get(f"{sidecar.url}/nothing").status_code == 404


async def test_tokenize_goes_to_the_first_healthy_upstreams_root(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    sidecar = start_sidecar([closed_url(), fakes[1].url, fakes[0].url])
    fakes[1].reset()
    out = httpx.post(f"{sidecar.root}/tokenize", json={"prompt": "four"})
    assert out.status_code == 200, out.text
    assert out.json()["tokens"] == [4]
    assert fakes[1].bodies == [{"prompt": "four"}]
    missing = httpx.post(f"{sidecar.root}/detokenize", json={"tokens": [1]})
    assert missing.status_code == 404  # the fake has no /detokenize: its answer, relayed
    info = httpx.get(f"{sidecar.root}/tokenizer_info")  # a GET, relayed as one
    assert info.json() == {"eos_token": "</s>", "method": "GET"}


async def test_a_silent_upstream_is_a_504_and_stays_healthy(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    sidecar = start_sidecar([fakes[0].url], timeout_s=0.2)
    answer = httpx.post(  # the upstream's 5 s: far past the 0.2 s even when the box is loaded
        f"{sidecar.url}/chat/completions", json=chat(SYSTEM, "x", x_fake={"delay": 5})
    )
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "upstream_timeout"
    assert httpx.get(f"{sidecar.root}/health").status_code == 200


async def test_a_client_leaving_a_slow_request_releases_it_at_once(sidecar: Server) -> None:
    body = chat(SYSTEM, "slow", x_fake={"delay": 60})
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.2)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{sidecar.url}/chat/completions", json=body)
    # released long before the upstream answers (60 s); the 10 s only bounds the wait
    await asyncio.to_thread(wait_until_idle, sidecar, 10.0)


async def test_metrics_show_routes_and_in_flight(sidecar: Server) -> None:
    httpx.post(f"{sidecar.url}/chat/completions", json=chat(SYSTEM, "Hi"))
    text = httpx.get(f"{sidecar.root}/metrics").text
    for url in (u.url for u in sidecar.app.state.upstream.pool.upstreams):
        assert f'prefixcache:upstream_in_flight{{upstream="{url}"}} 0.0' in text
    labels = {"route": "/v1/chat/completions", "method": "POST", "status": "200"}
    assert metric(sidecar.root, "prefixcache:http_requests_total", **labels) == 1
    assert routed(sidecar, "affinity") == 1
    assert routed(sidecar, "overflow") == routed(sidecar, "failover") == 0


# --- the official client --------------------------------------------------------------------


async def test_the_openai_client_works_through_the_sidecar(sidecar: Server) -> None:
    client = openai.AsyncOpenAI(base_url=sidecar.url, api_key="unused", max_retries=0, timeout=10)
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    completion = await client.chat.completions.create(model="m", messages=messages)
    owner = completion.model
    assert completion.choices[0].message.content == f"answer from {owner}"
    stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
    deltas = [chunk.choices[0].delta.content async for chunk in stream]
    assert deltas == [f"{owner}-0 ", f"{owner}-1 ", f"{owner}-2 "]
    for cut in ({"drop_after": 1}, {"drop_after": 1, "half_frame": True}):
        broken = await client.chat.completions.create(
            model="m", messages=messages, stream=True, extra_body={"x_fake": cut}
        )
        received = []
        with pytest.raises(openai.APIError, match="lost mid-response"):  # never a JSON error
            async for chunk in broken:
                received.append(chunk.choices[0].delta.content)
        assert received == [f"{owner}-0 "]  # the whole events only
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="m", messages=messages, extra_body={"x_fake": {"status": 400}}
        )
    await client.close()


# --- /reset_prefix_cache ----------------------------------------------------------------------


async def test_a_reset_goes_to_every_healthy_upstream_and_says_how_each_did(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    down = closed_url()
    sidecar = start_sidecar([*(fake.url for fake in fakes), down], routing="cache_aware")
    router = sidecar.app.state.upstream.router
    async with httpx.AsyncClient(base_url=sidecar.url, timeout=10) as client:
        for i in range(12):  # distinct prompts: the tree marks most upstreams
            assert (await client.post("/chat/completions", json=chat(f"{i} " * 50, "x"))).is_success
    marked = {url: chars for url, chars in router.tree.chars.items() if chars}
    fakes[1].reset_reply = (200, b'{"success": false}')  # vLLM's while blocks are held
    fakes[2].reset_reply = (404, b'{"detail": "Not Found"}')  # vLLM without dev mode
    reply = httpx.post(f"{sidecar.root}/reset_prefix_cache?reset_external=false", content=b"")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "success": False,
        "upstreams": [
            {"url": fakes[0].url, "status": 200, "success": True},
            {"url": fakes[1].url, "status": 200, "success": False},
            {"url": fakes[2].url, "status": 404, "success": False},
            {"url": down, "status": None, "success": False},
        ],
    }
    assert [fake.resets for fake in fakes] == [[("reset_external=false", b"", None)]] * 3
    # the upstream that reset lost its marks; the others keep theirs
    assert router.tree.chars.get(fakes[0].url, 0) == 0
    for fake in fakes[1:]:
        assert router.tree.chars.get(fake.url, 0) == marked.get(fake.url, 0)
    assert fakes[0].url in marked  # (so the first check could fail)
    for fake in fakes:
        fake.reset_reply = (200, b"")  # an older vLLM: 200, no body
    every = httpx.post(f"{sidecar.root}/reset_prefix_cache", json={})
    assert every.status_code == 200, every.text
    assert [u["success"] for u in every.json()["upstreams"]] == [True, True, True, False]
    assert [fake.resets[-1][:2] for fake in fakes] == [("", b"{}")] * 3  # the body as sent


async def test_a_reset_reports_success_when_every_upstream_reset(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    sidecar = start_sidecar([fake.url for fake in fakes])
    reply = httpx.post(f"{sidecar.root}/reset_prefix_cache")
    assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
    nobody = start_sidecar([closed_url()])
    refused = httpx.post(f"{nobody.root}/reset_prefix_cache")
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"]["code"] == "upstream_unreachable"


async def test_a_reset_needs_an_admin_key_where_keys_are_set(
    start_sidecar: Callable[..., Server], fakes: list[FakeUpstream]
) -> None:
    keys = KeyStore([("sk-client-key-001", "acme", False), ("sk-admin-key-0001", "ops", True)])
    sidecar = start_sidecar([fakes[0].url], keys=keys, upstream_api_key="sk-upstream")
    url = f"{sidecar.root}/reset_prefix_cache"
    assert httpx.post(url).status_code == 401
    tenant = httpx.post(url, headers={"authorization": "Bearer sk-client-key-001"})
    assert tenant.status_code == 403, tenant.text
    assert fakes[0].resets == []
    admin = httpx.post(url, headers={"authorization": "Bearer sk-admin-key-0001"})
    assert admin.status_code == 200 and admin.json()["success"] is True, admin.text
    assert fakes[0].resets == [("", b"", "Bearer sk-upstream")]  # the upstream's key, not ours
