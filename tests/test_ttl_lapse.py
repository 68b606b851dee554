"""TTL pins lapse on time, not on traffic (issue 30, item 1).

A clock the test moves stands in for time; no request runs after the pin is set. The lapse
must be visible at once to the stats, the cache page, evict and eviction under pressure (whose
cause is then "ttl"), in the block manager itself and through the HTTP API, where the idle
serving loop has to wake for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import TEST_MAX_MODEL_LEN, TEST_NUM_BLOCKS, serve

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.memory.prefix_tree import Node
from prefixcache.engine.serving.async_engine import AsyncEngine
from prefixcache.engine.step.engine_hooks import EngineHooks
from prefixcache.sidecar import SidecarSettings, create_app

BS = 16


@dataclass(slots=True)
class Clock:
    """Monotonic seconds that move only when the test says."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class Causes:
    """A block listener that keeps each eviction's cause."""

    removed: list[str] = field(default_factory=list)

    def block_stored(self, node: Node, root: bytes) -> None:
        pass

    def block_removed(self, node: Node, cause: str) -> None:
        self.removed.append(cause)

    def block_spilled(self, node: Node, tier: str) -> None:
        pass

    def tier_dropped(self, digest: bytes, tier: str) -> None:
        pass


def cached(bm: BlockManager, prompt: list[int]) -> None:
    """Compute ``prompt`` as a request would (index only), then let it go idle."""
    match = bm.match(prompt, "", len(prompt) - 1)
    table = bm.allocate(prompt, "", match, len(prompt))
    bm.commit(table, prompt, len(prompt))
    bm.free(table)


def lapsed_manager() -> tuple[BlockManager, Clock, Causes, list[int]]:
    clock, causes = Clock(), Causes()
    bm = BlockManager(8, BS, b"ttl-test", clock=clock, listener=causes)
    prompt = list(range(1, 4 * BS + 1))
    cached(bm, prompt)
    assert bm.pin(prompt, "", ttl_s=2.0) == 4
    assert bm.stats().num_ttl_pins == 1 and bm.num_pinned_blocks == 4
    clock.now += 8.0  # idle: nothing schedules, nothing is requested
    return bm, clock, causes, prompt


def test_stats_and_the_cache_view_see_the_lapse_without_a_step() -> None:
    bm, _, _, _ = lapsed_manager()
    stats = bm.stats()
    assert stats.num_ttl_pins == 0 and stats.num_pinned_blocks == 0
    assert bm.pinned_nodes() == [] and bm.ttl_time_left() == []
    bm.check_invariants()


def test_evict_takes_a_lapsed_prefix_without_a_step() -> None:
    bm, _, _, prompt = lapsed_manager()
    assert bm.evict_all() == 4
    assert bm.match(prompt, "", len(prompt)).num_tokens == 0


def test_pressure_evicts_a_lapsed_prefix_as_ttl() -> None:
    bm, _, causes, _ = lapsed_manager()
    other = list(range(500, 500 + 8 * BS))  # needs every page of the pool
    match = bm.match(other, "", len(other) - 1)
    assert bm.can_allocate(match, len(other))
    bm.allocate(other, "", match, len(other))
    assert causes.removed == ["ttl"] * 4
    bm.check_invariants()


def test_the_idle_loop_wakes_for_the_next_lapse() -> None:
    bm, clock, _, prompt = lapsed_manager()
    assert bm.next_pin_lapse() == 0.0  # due: the loop expires it at once
    assert bm.expire_pins() == 1 and bm.next_pin_lapse() is None  # nothing left to wake for
    cached(bm, prompt)
    bm.pin(prompt, "", ttl_s=3.0)
    assert bm.next_pin_lapse() == pytest.approx(3.0)
    clock.now += 2.0
    assert bm.next_pin_lapse() == pytest.approx(1.0)
    clock.now += 1.5
    assert bm.next_pin_lapse() == 0.0 and bm.expire_pins() == 1


DOC = "The ferry leaves the harbour at nine and returns by noon, weather allowing. " * 6


@pytest.fixture(scope="module")
def clocked_server(server_loop: Any, demo_loaded: Any) -> Any:
    clock = Clock()
    config = EngineConfig(  # conftest's demo engine, on a thread (the clock stays in-process)
        model="demo",
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        num_blocks=TEST_NUM_BLOCKS,
        max_model_len=TEST_MAX_MODEL_LEN,
    )
    engine = AsyncEngine(config, demo_loaded, EngineHooks(clock=clock))
    server = serve(server_loop, create_app(engine, SidecarSettings()))
    yield server.root, clock
    server.stop()


def test_an_idle_server_drops_a_lapsed_pin_at_its_time(clocked_server: Any) -> None:
    root, clock = clocked_server
    segments = [{"role": "system", "content": DOC, "tag": "doc", "stability": "static"}]
    warm = {"segments": segments, "pin": True, "ttl_s": 2}
    reply = httpx.post(f"{root}/v1/cache/warm", json=warm, timeout=120).json()
    pinned = reply["pinned_blocks"]
    assert pinned > 0
    assert httpx.get(f"{root}/v1/cache/stats").json()["blocks"]["pinned"] == pinned
    clock.now += 8.0  # from here on no request reaches the engine
    # The loop looks at least every 0.5 s; the deadline only bounds a hang (a pin never
    # dropped), so it is generous for a loaded box.
    deadline = time.monotonic() + 60.0
    while httpx.get(f"{root}/v1/cache/stats").json()["blocks"]["pinned"] != 0:
        assert time.monotonic() < deadline, "the lapsed pin still shows in /v1/cache/stats"
        time.sleep(0.05)
    tree = httpx.get(f"{root}/v1/cache/tree").json()  # the cache page's picture
    assert tree["nodes"] and not any(node.get("pinned") for node in tree["nodes"])
    evicted = httpx.post(f"{root}/v1/cache/evict", json={}).json()["evicted_blocks"]
    assert evicted >= pinned
    again = httpx.post(f"{root}/v1/cache/warm", json={"segments": segments}, timeout=120).json()
    assert again["cached_tokens"] == 0
