"""Miss reasons: each reason, on a real engine (demo model), in the per-segment usage."""

from __future__ import annotations

import random
import time

import pytest

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.miss_reasons import EvictionLog
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.request import EngineRequest, SamplingParams, SegmentMiss, SegmentSpan

BS = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo", dtype="float32", device="cpu")


def make_engine(loaded, num_blocks: int = 256) -> LLMEngine:
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=num_blocks)
    return LLMEngine(config, loaded)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def run(
    engine: LLMEngine,
    parts: list[tuple[str, list[int]]],
    namespace: str = "",
    tenant: str = "",
) -> list[SegmentMiss | None]:
    """One request of tagged parts; the miss of each segment."""
    prompt: list[int] = []
    spans = []
    for tag, ids in parts:
        spans.append(SegmentSpan(tag, len(prompt), len(prompt) + len(ids)))
        prompt += ids
    rid = f"r{time.monotonic_ns()}"
    request = EngineRequest(
        rid, prompt, SamplingParams(max_tokens=1), namespace=namespace, segments=spans
    )
    request.tenant = tenant
    [result] = engine.generate([request])
    assert result.usage.segments is not None
    engine.block_manager.check_invariants()
    return [s.miss for s in result.usage.segments]


def reasons(misses: list[SegmentMiss | None]) -> list[str | None]:
    return [m.reason if m is not None else None for m in misses]


def test_cold_names_the_first_segment(loaded) -> None:
    engine = make_engine(loaded)
    misses = run(engine, [("rules", tokens(1, 40)), ("q", tokens(2, 8))])
    assert reasons(misses) == ["cold", "cold"]
    assert misses[0] is not None and misses[0].segment == "rules"


def test_full_hit_has_no_miss(loaded) -> None:
    engine = make_engine(loaded)
    parts = [("rules", tokens(1, 40)), ("q", tokens(2, 8))]
    run(engine, parts)
    assert run(engine, parts) == [None, None]  # the last token is always computed: no miss


def test_below_min(loaded) -> None:
    engine = make_engine(loaded)
    assert reasons(run(engine, [("q", tokens(3, BS - 6))])) == ["below_min"]


def test_partial_block(loaded) -> None:
    engine = make_engine(loaded)
    doc = tokens(4, 2 * BS + 8)  # two full blocks are cached, 8 tokens stay private
    run(engine, [("doc", doc)])
    misses = run(engine, [("doc", doc), ("q", tokens(5, 5))])
    assert reasons(misses) == ["partial_block", "partial_block"]
    assert misses[0] is not None and misses[0].segment == "doc"


def test_diverged_names_the_segment_that_changed(loaded) -> None:
    engine = make_engine(loaded)
    rules, tools = tokens(6, 2 * BS), tokens(7, 2 * BS)
    run(engine, [("rules", rules), ("tools", tools), ("q", tokens(8, 20))])
    changed = [tools[0] + 1, *tools[1:]]
    misses = run(engine, [("rules", rules), ("tools", changed), ("q", tokens(8, 20))])
    assert reasons(misses) == [None, "diverged", "diverged"]
    assert {m.segment for m in misses if m is not None} == {"tools"}


def test_evicted_by_admin(loaded) -> None:
    engine = make_engine(loaded)
    parts = [("rules", tokens(9, 3 * BS)), ("q", tokens(10, 4))]
    run(engine, parts)
    before = time.time()
    assert engine.evict_all() > 0
    misses = run(engine, parts)
    assert reasons(misses) == ["evicted", "evicted"]
    miss = misses[0]
    assert miss is not None and miss.evicted_by == "admin" and miss.segment == "rules"
    assert miss.evicted_at is not None and before <= miss.evicted_at <= time.time()


def test_evicted_by_pressure(loaded) -> None:
    engine = make_engine(loaded, num_blocks=8)  # 128 token slots
    parts = [("rules", tokens(11, 4 * BS)), ("q", tokens(12, 4))]
    run(engine, parts)
    run(engine, [("other", tokens(13, 7 * BS))])  # needs the pages parts' blocks sit on
    misses = run(engine, parts)
    assert reasons(misses) == ["evicted", "evicted"]
    assert misses[0] is not None and misses[0].evicted_by == "pressure"


def test_evicted_by_ttl_after_its_retention_pin_lapsed(loaded) -> None:
    engine = make_engine(loaded, num_blocks=8)
    parts = [("rules", tokens(21, 4 * BS)), ("q", tokens(22, 4))]
    run(engine, parts)
    prompt = [t for _, ids in parts for t in ids]
    assert engine.pin(prompt, "", ttl_s=0.05) == 4
    time.sleep(0.1)  # lapses at the next step's expire_pins, then pressure takes the pages
    run(engine, [("other", tokens(23, 7 * BS))])
    misses = run(engine, parts)
    assert reasons(misses) == ["evicted", "evicted"]
    assert misses[0] is not None and misses[0].evicted_by == "ttl"
    run(engine, [("other", tokens(24, 7 * BS))])  # the same blocks again, never pinned now
    again = run(engine, parts)
    assert again[0] is not None and again[0].evicted_by == "pressure"


def test_namespace_another_salt_of_the_same_tenant(loaded) -> None:
    engine = make_engine(loaded)
    parts = [("rules", tokens(14, 3 * BS)), ("q", tokens(15, 4))]
    run(engine, parts, namespace="acme-salt-1", tenant="acme")
    misses = run(engine, parts, namespace="acme-salt-2", tenant="acme")
    assert reasons(misses) == ["namespace", "namespace"]


def test_namespace_never_looks_at_other_tenants(loaded) -> None:
    engine = make_engine(loaded)
    parts = [("rules", tokens(16, 3 * BS)), ("q", tokens(17, 4))]
    run(engine, parts, namespace="acme-salt-1", tenant="acme")
    assert reasons(run(engine, parts, namespace="globex-1", tenant="globex")) == ["cold", "cold"]
    assert reasons(run(engine, parts, namespace="nobody")) == ["cold", "cold"]


def test_eviction_log_is_bounded() -> None:
    log = EvictionLog(capacity=3)
    for i in range(5):
        log.record(bytes([i]), "pressure")
    assert len(log) == 3
    assert log.find(bytes([0])) is None and log.find(bytes([4])) is not None
