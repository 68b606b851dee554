"""The cache page's data: the folded tree (bounded for 100K blocks), the live stream, auth,
and miss reasons in replies (sidecar JSON and the SDK)."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import msgspec
import pytest
from conftest import (
    KEYS,
    TEST_MAX_MODEL_LEN,
    TEST_NUM_BLOCKS,
    Server,
    ServerLoop,
    serve,
    wait_for_idle_blocks,
)

from prefixcache.engine.api import RequestRecord, TreeSnapshot
from prefixcache.sdk import Client, Prompt
from prefixcache.sdk.types import CacheStats, TierBlockStats
from prefixcache.sidecar.server.activity_window import ActivityWindow, ttft_bin, ttft_of
from prefixcache.sidecar.server.app import SidecarSettings, create_app
from prefixcache.sidecar.server.cache_view import build_view
from prefixcache.sidecar.server.dashboard import BACKLOG, DashboardRoutes

BS = 16


def snapshot(
    parent: list[int],
    namespaces: int = 1,
    hits: list[int] | None = None,
    pinned: list[bool] | None = None,
    ttl_expires: list[float] | None = None,
) -> TreeSnapshot:
    n = len(parent)
    return TreeSnapshot(
        BS,
        time.time(),
        [f"ns{k}" for k in range(namespaces)],
        parent,
        [False] * n,
        pinned or [False] * n,
        hits or [0] * n,
        [0.0] * n,
        [""] * n,
        ttl_expires or [0.0] * n,
    )


def check_widths(view) -> None:
    """Children never outgrow their parent, and the namespaces hold every cached block."""
    by_id = {node.id: node for node in view.nodes}
    below: dict[int, int] = {}
    for node in view.nodes:
        if node.parent >= 0:
            below[node.parent] = below.get(node.parent, 0) + node.total
    for pid, total in below.items():
        parent = by_id[pid]
        assert total == parent.total - parent.tokens, (parent, total)
    namespaces = [n for n in view.nodes if n.kind == "namespace"]
    assert sum(n.total for n in namespaces) == view.num_blocks * BS


def test_chains_are_one_node_and_wide_children_fold() -> None:
    # ns0: a chain 0-1-2 that branches into 3 and 4 (3 continues to 5); 30 top blocks below 6
    parent = [-1, 0, 1, 2, 2, 3]
    parent += [-1]  # 6
    parent += [6] * 30  # 7..36
    hits = [0] * len(parent)
    hits[5] = 4
    view = build_view(snapshot(parent, hits=hits), max_children=8)
    prefixes = [n for n in view.nodes if n.kind == "prefix"]
    chain = next(n for n in prefixes if n.start == 0 and n.tokens == 3 * BS)
    assert chain.total == 6 * BS and chain.hits == 4
    more = [n for n in view.nodes if n.kind == "more"]
    assert len(more) == 1 and more[0].folded == 30 - 7 and view.folded
    assert view.top_by_hits[0].hits == 4 and view.top_by_hits[0].tokens == 5 * BS
    assert view.top_by_size[0].tokens == 31 * BS
    check_widths(view)


def test_pins_and_ttl_pins_reach_the_picture() -> None:
    # ns0: 0-1 (TTL-pinned to 500) and 2 (pinned for good); ns1: 3 under a TTL pin, 4 bare;
    # ns2: 5..24 side by side, mostly folded, the last of them TTL-pinned
    parent = [-1, 0, -1, -2, -2] + [-3] * 20
    pinned = [True, True, True, True] + [False] * 21
    ttl = [500.0, 500.0, 0.0, 700.0] + [0.0] * 21
    pinned[24], ttl[24] = True, 900.0  # the last: folded (the largest, then the first, drawn)
    view = build_view(
        snapshot(parent, namespaces=3, pinned=pinned, ttl_expires=ttl), max_children=4
    )
    prefixes = [n for n in view.nodes if n.kind == "prefix"]
    spaces = [n for n in view.nodes if n.kind == "namespace"]
    ttl_chain = next(n for n in prefixes if n.tokens == 2 * BS)
    assert ttl_chain.pinned and ttl_chain.ttl_expires == 500.0
    for_good = next(n for n in prefixes if n.pinned and n.ttl_expires == 0.0)
    assert for_good.tokens == BS and for_good.parent == ttl_chain.parent
    assert spaces[0].pinned and spaces[0].ttl_expires == 0.0  # a pin for good holds some of it
    assert spaces[1].pinned and spaces[1].ttl_expires == 700.0  # only TTL pins hold it
    (more,) = [n for n in view.nodes if n.kind == "more"]
    assert more.parent == spaces[2].id and more.pinned and more.ttl_expires == 900.0
    assert spaces[2].pinned and spaces[2].ttl_expires == 900.0
    biggest = view.top_by_size[0]
    assert biggest.tokens == 2 * BS and biggest.pinned and biggest.ttl_expires == 500.0
    assert {(t.pinned, t.ttl_expires) for t in view.top_by_size} >= {(True, 0.0), (False, 0.0)}
    wire = msgspec.json.decode(msgspec.json.encode(view))
    assert {"pinned", "ttl_expires"} <= set(wire["nodes"][1])


def record(seq: int, at: float, prompt: int = 100, cached: int = 50, ttft: float | None = 0.2):
    return RequestRecord(seq, at, prompt, cached, ttft, "length", "ns", None)


def test_the_activity_window_keeps_totals_of_every_request_it_saw() -> None:
    window = ActivityWindow()
    t0 = 1_000_000.0  # a bucket boundary
    window.observe([record(1, t0 + 1), record(2, t0 + 9, ttft=None), record(3, t0 + 11)])
    first = window.since(0, t0 + 12)
    assert [(b.start, b.requests, b.prompt_tokens, b.cached_tokens) for b in first] == [
        (t0, 2, 200, 100),
        (t0 + 10, 1, 100, 50),
    ]
    assert sum(first[0].ttft.values()) == 1  # the one with a first token
    seen = window.version
    window.observe([record(3, t0 + 11), record(7, t0 + 15)])  # 3 again; 4..6 were never seen
    (changed,) = window.since(seen, t0 + 16)
    assert changed.start == t0 + 10 and changed.requests == 2 and changed.missed == 3
    assert window.since(window.version, t0 + 16) == []
    assert [b.start for b in window.since(0, t0 + 615)] == [t0 + 10]  # the oldest expired


class Busy:
    """What the live stream reads of an engine that finished 1500 requests in 5 minutes."""

    is_ready = True
    num_waiting = 0

    def __init__(self) -> None:
        now = time.time()
        self.records = [record(i + 1, now - 300 + i * 0.2, ttft=0.05) for i in range(1500)]

    def cache_activity(self, after: int = 0) -> list[RequestRecord]:
        return [r for r in self.records if r.seq > after]

    def cache_stats(self) -> CacheStats:
        return CacheStats()


async def test_the_first_event_counts_every_request_not_just_the_backlog() -> None:
    routes = DashboardRoutes(Busy(), gate=None)  # type: ignore[arg-type]
    events = routes._events(interval=0.1)
    first = json.loads((await anext(events))[6:])
    await events.aclose()
    assert len(first["requests"]) == BACKLOG < 1500  # the last misses: a bounded backlog
    assert sum(b["requests"] for b in first["window"]) == 1500  # the figures: every request
    assert sum(b["cached_tokens"] for b in first["window"]) == 1500 * 50
    assert first["tier"] is None


def test_ttft_bins_are_within_a_tenth() -> None:
    for seconds in (0.0003, 0.004, 0.05, 0.7, 9.0, 120.0):
        assert abs(ttft_of(ttft_bin(seconds)) / seconds - 1) < 0.08
    assert ttft_bin(0.0) == 0 and ttft_bin(1e9) == ttft_bin(1e6)  # both ends bounded


def big_tree(num_blocks: int, seed: int = 3) -> list[int]:
    """Deep chains, bushy subtrees and one very wide node, parents first."""
    rng = random.Random(seed)
    parent = [-1]  # a wide root-level block with many children
    while len(parent) < num_blocks // 4:
        parent.append(0)
    deep_top = len(parent)
    parent.append(-1)
    for _ in range(num_blocks // 4):  # one very deep chain
        parent.append(len(parent) - 1)
    while len(parent) < num_blocks:  # random prefixes: mostly extend, sometimes branch
        if rng.random() < 0.02:
            parent.append(-1)
        elif rng.random() < 0.7:
            parent.append(len(parent) - 1)
        else:
            parent.append(rng.randrange(deep_top + num_blocks // 4, len(parent)))
    return parent


def test_100k_blocks_fold_to_a_bounded_reply_quickly() -> None:
    parent = big_tree(100_000)
    hits = [random.Random(1).randrange(0, 3) for _ in parent]
    snap = snapshot(parent, hits=hits)
    began = time.thread_time()  # this thread's CPU time: a loaded box's waits do not count
    view = build_view(snap, max_nodes=1500)
    elapsed = time.thread_time() - began
    body = msgspec.json.encode(view)
    assert view.num_blocks == 100_000 and view.folded
    assert len(view.nodes) <= 2 * 1500
    assert len(body) < 600_000, len(body)
    assert elapsed < 5.0, f"folding 100K blocks took {elapsed:.2f} s of CPU"  # ~0.3 s here
    check_widths(view)
    deep = max((n for n in view.nodes if n.kind == "prefix"), key=lambda n: n.tokens)
    assert deep.tokens == (100_000 // 4 + 1) * BS  # the deep chain is one node


def test_tree_and_live_stream_over_a_real_engine(sidecar_server: Server) -> None:
    root = sidecar_server.root
    body = {"prompt": "dashboard data test " * 8, "max_tokens": 1}
    assert httpx.post(f"{root}/v1/completions", json=body, timeout=60).status_code == 200
    tree = httpx.get(f"{root}/v1/cache/tree", timeout=30).json()
    assert tree["num_blocks"] > 0 and any(n["kind"] == "prefix" for n in tree["nodes"])
    with httpx.stream("GET", f"{root}/v1/cache/live?interval=0.2", timeout=30) as res:
        assert res.status_code == 200
        assert res.headers["content-type"].startswith("text/event-stream")
        lines = res.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    assert first["blocks"]["total"] > 0 and first["requests"]
    assert sum(b["requests"] for b in first["window"]) >= 1  # the last minutes, whole
    assert {"prompt_tokens", "cached_tokens", "ttft_s", "miss"} <= set(first["requests"][-1])
    html = httpx.get(f"{root}/dashboard", timeout=10)
    assert html.status_code == 200 and "<svg" not in html.text  # drawn by the page's script
    assert "/v1/cache/live" in html.text and "<script src" not in html.text  # no CDN


@pytest.fixture(scope="module", params=["thread", "process"])
def tier_sidecar(request: pytest.FixtureRequest, server_loop: ServerLoop, demo_loaded: Any):
    """A fresh engine with a host tier, in the sidecar's process (AsyncEngine) or its own."""
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.serving.async_engine import AsyncEngine
    from prefixcache.engine.serving.process_engine import ProcessEngine

    config = EngineConfig(
        model="demo", dtype="float32", device="cpu", attention_backend="torch",
        num_blocks=TEST_NUM_BLOCKS, max_model_len=TEST_MAX_MODEL_LEN, kv_offload="host:0.05",
    )  # fmt: skip
    engine = (
        AsyncEngine(config, demo_loaded) if request.param == "thread" else ProcessEngine(config)
    )
    server = serve(server_loop, create_app(engine, SidecarSettings()))
    yield server
    server.stop()


def test_ttl_pins_and_the_tier_reach_stats_tree_and_stream(tier_sidecar: Server) -> None:
    root = tier_sidecar.root
    doc = [{"role": "system", "content": "[ttl view] " + "keep the receipts. " * 12, "tag": "doc",
            "stability": "static"}]  # fmt: skip
    other = {"prompt": "[tier view] spilled into the host tier " * 6, "max_tokens": 1}
    assert httpx.post(f"{root}/v1/completions", json=other, timeout=120).status_code == 200
    wait_for_idle_blocks(root)
    spilled = httpx.post(f"{root}/v1/cache/evict", json={"keep_tier": True}, timeout=60).json()
    assert spilled["evicted_blocks"] > 0
    began = time.time()
    warm = {"segments": doc, "pin": True, "ttl_s": 120}
    warmed = httpx.post(f"{root}/v1/cache/warm", json=warm, timeout=120).json()
    assert warmed["pinned_blocks"] > 0, warmed

    stats = httpx.get(f"{root}/v1/cache/stats", timeout=10).json()
    assert stats["blocks"]["pinned"] == warmed["pinned_blocks"]  # the old fields stay
    tier = stats["tier"]
    assert tier["kind"] == "host" and tier["used"] >= spilled["evicted_blocks"] > 0
    assert tier["total"] > tier["used"] and tier["bytes_used"] * tier["total"] == (
        tier["bytes_total"] * tier["used"]
    )

    with Client(tier_sidecar.url) as client:
        sdk_tier = client.cache_stats().tier
    assert isinstance(sdk_tier, TierBlockStats) and sdk_tier.used == tier["used"]

    tree = httpx.get(f"{root}/v1/cache/tree", timeout=30).json()
    ttl = [n for n in tree["nodes"] if n["kind"] == "prefix" and n.get("ttl_expires")]
    assert ttl and all(n["pinned"] for n in ttl)
    assert all(began + 110 < n["ttl_expires"] < time.time() + 121 for n in ttl)

    with httpx.stream("GET", f"{root}/v1/cache/live?interval=0.2", timeout=30) as res:
        line = next(line for line in res.iter_lines() if line.startswith("data: "))
    assert json.loads(line[6:])["tier"] == tier


@pytest.mark.parametrize("path", ["/v1/cache/tree", "/v1/cache/live"])
def test_dashboard_data_needs_an_admin_key_as_a_header(tenant_server: Server, path: str) -> None:
    url = tenant_server.root + path
    assert httpx.get(url, timeout=10).status_code == 401
    tenant = {"Authorization": f"Bearer {KEYS['a']['key']}"}
    assert httpx.get(url, headers=tenant, timeout=10).status_code == 403
    # never in a URL: an admin key as ?key= is no key at all
    assert httpx.get(url, params={"key": KEYS["admin"]["key"]}, timeout=10).status_code == 401
    if path != "/v1/cache/live":
        admin = {"Authorization": f"Bearer {KEYS['admin']['key']}"}
        assert httpx.get(url, headers=admin, timeout=30).status_code == 200


def test_the_page_holds_no_data_and_asks_for_the_key(tenant_server: Server) -> None:
    page = httpx.get(f"{tenant_server.root}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["referrer-policy"] == "no-referrer"
    html = page.text
    assert 'id="key-input" type="password"' in html and "Authorization" in html
    assert 'location.search).get("key")' not in html  # the old page read ?key=


def test_bad_parameters_are_400(sidecar_server: Server) -> None:
    root = sidecar_server.root
    for query in ("max_nodes=3", "max_nodes=x", "max_nodes=99999"):
        res = httpx.get(f"{root}/v1/cache/tree?{query}", timeout=10)
        assert res.status_code == 400 and res.json()["error"]["param"] == "max_nodes"
    assert httpx.get(f"{root}/v1/cache/live?interval=0", timeout=10).status_code == 400


def test_miss_reasons_in_replies_and_the_sdk(sidecar_server: Server) -> None:
    rules = "[miss-reasons] Answer in one short sentence and cite the shelf. " * 6

    def prompt(doc: str) -> Prompt:
        return (
            Prompt.builder()
            .static(rules, tag="rules")
            .shared(doc * 4, tag="doc")
            .dynamic("Which shelf?", tag="q")
            .build()
        )

    with Client(sidecar_server.url) as client:
        first = client.complete(prompt("Shelf A: atlases. "), max_tokens=1)
        assert first.cache is not None
        # cold, or diverged after the chat template's opening tokens other tests cached
        assert first.cache.segment("rules").miss_reason in ("cold", "diverged")
        second = client.complete(prompt("Shelf B: poetry. "), max_tokens=1)
    assert second.cache is not None
    doc = second.cache.segment("doc")
    assert doc.miss_reason == "diverged" and isinstance(doc.miss, dict)
    assert doc.miss["segment"] == "doc"
    assert second.cache.segment("rules").miss is None  # fully cached


def test_engine_snapshot_of_100k_blocks_is_one_quick_pass() -> None:
    from prefixcache.engine.memory.block_manager import BlockManager
    from prefixcache.engine.observability.cache_activity import CacheActivity

    manager = BlockManager(100_000, BS, identity=b"snapshot-test")
    activity = CacheActivity(manager)
    rng = random.Random(5)
    trunk = [rng.randrange(3, 30000) for _ in range(200 * BS)]
    while manager.num_free_blocks > 1100:  # a shared trunk, then 1000-block branches
        prompt = trunk + [rng.randrange(3, 30000) for _ in range(1000 * BS)]
        match = manager.match(prompt, "ns", len(prompt) - 1)
        table = manager.allocate(prompt, "ns", match, len(prompt))
        manager.commit(table, prompt, len(prompt))
        manager.free(table)
    began = time.thread_time()  # CPU time, as above
    snap = activity.snapshot()
    elapsed = time.thread_time() - began
    assert len(snap.parent) > 98_000 and all(p < i for i, p in enumerate(snap.parent))
    assert elapsed < 3.0, f"the engine-side copy took {elapsed:.2f} s of CPU"  # ~0.1 s here
    view = build_view(snap)
    assert len(view.nodes) <= 2 * 1500
    check_widths(view)


def test_another_salt_of_the_same_tenant_is_a_namespace_miss(sidecar_server: Server) -> None:
    def ask(salt: str) -> dict:
        body = {
            "model": "demo",
            "segments": [
                {"role": "system", "content": "[salted] keep it short. " * 8, "tag": "rules",
                 "stability": "static"},
                {"role": "user", "content": "Which shelf?", "tag": "q"},
            ],
            "cache_salt": salt,
            "max_tokens": 1,
        }  # fmt: skip
        res = httpx.post(f"{sidecar_server.url}/chat/completions", json=body, timeout=60)
        assert res.status_code == 200, res.text
        return res.json()["prefixcache"]["segments"][0]

    ask("salt-one")
    rules = ask("salt-two")
    assert rules["cached_tokens"] == 0 and rules["miss"]["reason"] == "namespace"


@pytest.mark.parametrize(
    ("line", "logged"),
    [
        ("GET /dashboard?key=sk-ops-1 HTTP/1.1", "GET /dashboard?key=[redacted] HTTP/1.1"),
        ("/x?a=1&API_KEY=s3&max_tokens=5", "/x?a=1&API_KEY=[redacted]&max_tokens=5"),
        ("/t?access_token=abc#top", "/t?access_token=[redacted]#top"),
        ("prefill tokens=5 key=3", "prefill tokens=5 key=3"),  # not a query: left alone
    ],
)
def test_the_logs_redact_secret_looking_query_values(line: str, logged: str) -> None:
    import logging

    from prefixcache.sidecar.http.redaction import RedactSecrets

    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "%s", (line,), None)
    assert RedactSecrets().filter(record) and record.getMessage() == logged
