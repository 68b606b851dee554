"""The cache page's data: the folded tree (bounded for 100K blocks), the live stream, auth,
and miss reasons in replies (sidecar JSON and the SDK)."""

from __future__ import annotations

import json
import random
import time

import httpx
import msgspec
import pytest
from conftest import KEYS, Server

from prefixcache.engine.api import TreeSnapshot
from prefixcache.sdk import Client, Prompt
from prefixcache.sidecar.cache_view import build_view

BS = 16


def snapshot(parent: list[int], namespaces: int = 1, hits: list[int] | None = None) -> TreeSnapshot:
    n = len(parent)
    return TreeSnapshot(
        BS,
        time.time(),
        [f"ns{k}" for k in range(namespaces)],
        parent,
        [False] * n,
        [False] * n,
        hits or [0] * n,
        [0.0] * n,
        [""] * n,
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
    began = time.perf_counter()
    view = build_view(snap, max_nodes=1500)
    elapsed = time.perf_counter() - began
    body = msgspec.json.encode(view)
    assert view.num_blocks == 100_000 and view.folded
    assert len(view.nodes) <= 2 * 1500
    assert len(body) < 600_000, len(body)
    assert elapsed < 5.0, f"folding 100K blocks took {elapsed:.2f}s"  # ~0.3 s unloaded
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
    assert {"prompt_tokens", "cached_tokens", "ttft_s", "miss"} <= set(first["requests"][-1])
    html = httpx.get(f"{root}/dashboard", timeout=10)
    assert html.status_code == 200 and "<svg" not in html.text  # drawn by the page's script
    assert "/v1/cache/live" in html.text and "<script src" not in html.text  # no CDN


@pytest.mark.parametrize("path", ["/dashboard", "/v1/cache/tree", "/v1/cache/live"])
def test_dashboard_routes_need_an_admin_key(tenant_server: Server, path: str) -> None:
    url = tenant_server.root + path
    assert httpx.get(url, timeout=10).status_code == 401
    tenant = {"Authorization": f"Bearer {KEYS['a']['key']}"}
    assert httpx.get(url, headers=tenant, timeout=10).status_code == 403
    assert httpx.get(url, params={"key": KEYS["a"]["key"]}, timeout=10).status_code == 403
    if path != "/v1/cache/live":
        ok = httpx.get(url, params={"key": KEYS["admin"]["key"]}, timeout=30)
        assert ok.status_code == 200


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
    from prefixcache.engine.block_manager import BlockManager
    from prefixcache.engine.cache_activity import CacheActivity

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
    began = time.perf_counter()
    snap = activity.snapshot()
    elapsed = time.perf_counter() - began
    assert len(snap.parent) > 98_000 and all(p < i for i, p in enumerate(snap.parent))
    assert elapsed < 3.0, f"the engine-side copy took {elapsed:.2f}s"  # ~0.1 s unloaded
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
