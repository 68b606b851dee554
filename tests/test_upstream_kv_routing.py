"""Cache-aware routing over prefixcache engines that publish KV events (loopback, demo model).

Three engine-mode sidecars (``--model demo``, events on, token ids published) behind an
upstream-mode sidecar with the demo tokenizer: multi-turn conversations keep hitting the
replica that holds their history, a restarted replica stops attracting its old prefixes, and a
skewed workload (one hot prefix) still spreads.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Server, ServerLoop, demo_engine, serve

from prefixcache.sidecar.router.app import EventSource, UpstreamSettings, create_upstream_app
from prefixcache.sidecar.server.app import SidecarSettings, create_app

pytest.importorskip("zmq")

WORDS = [
    "timetable",
    "harbour",
    "ferry",
    "station",
    "platform",
    "coastal",
    "express",
    "ticket",
    "window",
    "island",
    "bridge",
    "market",
    "lighthouse",
    "village",
    "terminal",
    "morning",
    "evening",
    "schedule",
    "connection",
    "transfer",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(i: int, words: int = 90) -> str:
    return f"Agent {i}. " + " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(words))


def serve_on(loop: ServerLoop, app: Any, port: int) -> Server:
    """``conftest.serve`` on a fixed port (a restarted replica keeps its URL)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if done.done():
            done.result()
        if time.monotonic() > deadline:
            raise TimeoutError(root)
        time.sleep(0.05)
    return Server(f"{root}/v1", root, app, server, done)


class Replica:
    def __init__(self, loop: ServerLoop, loaded: Any) -> None:
        self.loop, self.loaded = loop, loaded
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.server: Server | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def source(self) -> EventSource:
        return EventSource(f"tcp://127.0.0.1:{self.events}", f"tcp://127.0.0.1:{self.replay}")

    def start(self) -> None:
        engine = demo_engine(
            self.loaded,
            kv_events_endpoint=f"tcp://127.0.0.1:{self.events}",
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{self.replay}",
            kv_events_token_ids="all",
        )
        self.server = serve_on(self.loop, create_app(engine, SidecarSettings()), self.port)

    def stop(self) -> None:
        assert self.server is not None
        self.server.stop()
        self.server = None


@pytest.fixture(scope="module")
def replicas(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[list[Replica]]:
    started = [Replica(server_loop, demo_loaded) for _ in range(3)]
    yield started
    for replica in started:
        if replica.server is not None:
            replica.stop()


@pytest.fixture
def router(server_loop: ServerLoop, replicas: list[Replica]) -> Iterator[Server]:
    from prefixcache.engine.model.demo_model import ensure_demo_model
    from prefixcache.engine.text.tokenizer import Tokenizer

    settings = UpstreamSettings(
        tuple(r.url for r in replicas),
        events={r.url: r.source for r in replicas},
        tokenizer=Tokenizer.from_folder(ensure_demo_model()),
    )
    server = serve(server_loop, create_upstream_app(settings), health=False)
    yield server
    server.stop()


def proxy_of(server: Server) -> Any:
    return server.app.state.upstream


def chat(router: Server, messages: list[dict[str, str]], max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{router.url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decisions(router: Server) -> dict[tuple[str, str], float]:
    counter = proxy_of(router).metrics.decisions
    return {
        (s.labels["upstream"], s.labels["reason"]): s.value
        for metric in counter.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def last_decision(router: Server, before: dict[tuple[str, str], float]) -> tuple[str, str]:
    after = decisions(router)
    (changed,) = [k for k, v in after.items() if v != before.get(k, 0)]
    return changed


def wait_for_events(router: Server, timeout: float = 30.0) -> None:
    """Until every replica's index stopped changing (its events for the last request came):
    unchanged for a whole second, not a quarter (a loaded box spaces the batches out); the
    timeout bounds a hang."""
    proxy = proxy_of(router)
    deadline = time.monotonic() + timeout
    previous, still = None, 0
    while time.monotonic() < deadline:
        now = [len(r.index) for r in proxy.router.replicas.values()]
        still = still + 1 if now == previous else 0
        if still >= 4:
            return
        previous = now
        time.sleep(0.25)


def test_multi_turn_conversations_keep_hitting_their_replica(router: Server) -> None:
    conversations = [[{"role": "system", "content": system_prompt(i)}] for i in range(6)]
    homes: dict[int, str] = {}
    prompt_len: dict[int, int] = {}
    for turn in range(3):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Turn {turn}: which ferry for {i}?"})
            before = decisions(router)
            reply = chat(router, messages)
            upstream, reason = last_decision(router, before)
            usage = reply["usage"]
            if turn == 0:
                homes[i] = upstream
            else:
                assert upstream == homes[i], (i, turn)
                assert reason == "precise"
                # the whole previous prompt (its full blocks) came from the cache
                assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_len[i] - 16
            prompt_len[i] = usage["prompt_tokens"]
            messages.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            )
        wait_for_events(router)
    assert len(set(homes.values())) >= 2, "six new conversations should not all share one replica"


def test_a_restarted_replica_stops_attracting_its_old_prefixes(
    router: Server, replicas: list[Replica]
) -> None:
    messages = [
        {"role": "system", "content": system_prompt(40)},
        {"role": "user", "content": "First question?"},
    ]
    chat(router, messages)
    wait_for_events(router)
    before = decisions(router)
    chat(router, messages)
    home, reason = last_decision(router, before)
    assert reason == "precise"
    proxy = proxy_of(router)
    tokens = proxy.reader.chat({"model": "demo", "messages": messages}).token_ids
    index = proxy.router.replicas[home].index
    assert index.match(tokens) > 0
    replica = next(r for r in replicas if r.url == home)
    replica.stop()
    replica.start()  # a fresh pool: its first batch is AllBlocksCleared
    deadline = time.monotonic() + 60  # a hang bound: a replica's restart is slow under load
    while index.match(tokens) and time.monotonic() < deadline:
        time.sleep(0.1)  # no request needed: the reconnection's replay shows the restart
    assert index.match(tokens) == 0, "the restart did not clear the replica's index"
    before = decisions(router)
    reply = chat(router, messages)
    _, reason = last_decision(router, before)
    assert reason != "precise"  # nothing holds the prefix any more: no one is predicted a hit
    # at most the chat template's header is shared with other requests: not a block
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] < 16


def test_balance_holds_under_a_skewed_workload(router: Server) -> None:
    hot = system_prompt(99, words=120)
    chat(router, [{"role": "system", "content": hot}, {"role": "user", "content": "warm"}])
    wait_for_events(router)
    before = decisions(router)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": "demo",
            "messages": [
                {"role": "system", "content": hot},
                {"role": "user", "content": f"Question {i}?"},
            ],
            "max_tokens": 64,
            "temperature": 0,
        }
        response = await client.post(f"{router.url}/chat/completions", json=body, timeout=300)
        assert response.status_code == 200

    async def burst() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(one(client, i) for i in range(18)))

    asyncio.run(burst())
    after = decisions(router)
    per_upstream: dict[str, float] = {}
    for (upstream, _), value in after.items():
        per_upstream[upstream] = (
            per_upstream.get(upstream, 0) + value - before.get((upstream, _), 0)
        )
    counts = sorted(per_upstream.values())
    assert sum(counts) == 18
    assert counts[0] >= 2, f"one replica was starved: {per_upstream}"
    assert counts[-1] <= 12, f"the hot prefix's replica took nearly everything: {per_upstream}"
