"""The KV tier (``--kv-offload``) on a hybrid model: the demo Llama with every other layer
sliding (window 40), as in tests/test_hybrid_engine.py, whose null local page is NaN. Evicted
blocks spill their global pages into the tier and their local pages into its second part; a
local page taken alone under local-pool pressure spills too. A later hit reloads the global
pages and refills its window's local pages, with the cold run's greedy tokens; a lost or
corrupt entry shortens the hit, never the tokens."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_hybrid_engine import hybrid_loaded, make_engine, prompt, reference_backend, run

from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.hybrid.manager import HybridBlockManager
from prefixcache.engine.model.loader import LoadedModel
from prefixcache.engine.request import EngineRequest, RequestOutput, SamplingParams

__all__ = ["hybrid_loaded", "reference_backend"]  # fixtures shared with test_hybrid_engine

BS = 16
TIER = "host:0.05"  # 50 MB: every block of these tests


def manager_of(engine: LLMEngine) -> HybridBlockManager:
    assert isinstance(engine.block_manager, HybridBlockManager)
    return engine.block_manager


def cold(loaded: LoadedModel, tokens: list[int]) -> list[tuple[int, float]]:
    ((out, cached),) = run(make_engine(loaded, enable_prefix_caching=False), [tokens])
    assert cached == 0
    return out


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """The same greedy tokens, logprobs within fp32 reduction noise (the windowed reference
    sums a warm suffix's keys in another order than the cold prompt's)."""
    return [t for t, _ in a] == [t for t, _ in b] and all(
        abs(x - y) <= 5e-4 for (_, x), (_, y) in zip(a, b, strict=True)
    )


@contextmanager
def spilled(
    loaded: LoadedModel, computed: list[int], tier: str = TIER, **config: Any
) -> Iterator[LLMEngine]:
    """An engine with a KV tier that computed ``computed`` and then emptied its pool into the
    tier (every block spills: global and local pages); closed after."""
    engine = make_engine(loaded, kv_offload=tier, **config)
    try:
        run(engine, [computed], max_tokens=1)
        engine.evict_all(keep_tier=True)
        yield engine
    finally:
        engine.close()


def full_blocks(n: int) -> int:
    return n // BS * BS


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10_000), length=st.integers(17, 160), extra=st.integers(1, 30))
def test_a_hit_reloaded_from_the_tier_gives_the_cold_tokens(
    hybrid_loaded: LoadedModel, seed: int, length: int, extra: int
) -> None:
    tokens = prompt(seed, length + extra, hybrid_loaded)
    with spilled(hybrid_loaded, tokens[:length]) as engine:
        manager = manager_of(engine)
        assert manager.stats().num_cached_idle_blocks == 0
        ((warm, cached),) = run(engine, [tokens])
        assert same(warm, cold(hybrid_loaded, tokens))
        assert cached == full_blocks(length) and manager.stats().reloaded_tokens == cached
        assert manager.stats().num_local_held == 0


def test_local_pages_taken_under_pressure_are_refilled_from_the_tier(
    hybrid_loaded: LoadedModel,
) -> None:
    """A local pool of 7 pages: running other prompts takes the first one's idle window
    pages while its global pages stay cached; its next hit refills them."""
    config = {"max_num_seqs": 1, "max_num_batched_tokens": 32, "swa_pool_ratio": 0.1}
    engine = make_engine(hybrid_loaded, kv_offload=TIER, **config)
    try:
        manager = manager_of(engine)
        assert manager.local.num_pages - 1 == 7
        first = prompt(20, 150, hybrid_loaded)
        run(engine, [first], max_tokens=1)
        run(engine, [prompt(21 + i, 60, hybrid_loaded) for i in range(3)], max_tokens=1)
        blocks = manager.match(first, "", 144).blocks
        assert len(blocks) == 9, "the global pages are still cached"
        assert all(manager.local.page_of[b] == 0 for b in blocks[6:]), "the window's pages went"
        assert manager.local_tier is not None and len(manager.local_tier) > 0
        ((warm, cached),) = run(engine, [first])
        assert cached == 144 and same(warm, cold(hybrid_loaded, first))
        assert manager.stats().reloaded_tokens == 0  # the global pages never left the pool
    finally:
        engine.close()


def test_without_the_tier_the_same_pressure_loses_the_hit(hybrid_loaded: LoadedModel) -> None:
    """The control of the test above: no tier, no window, no hit past the first block."""
    config = {"max_num_seqs": 1, "max_num_batched_tokens": 32, "swa_pool_ratio": 0.1}
    engine = make_engine(hybrid_loaded, **config)
    first = prompt(20, 150, hybrid_loaded)
    run(engine, [first], max_tokens=1)
    run(engine, [prompt(21 + i, 60, hybrid_loaded) for i in range(3)], max_tokens=1)
    assert manager_of(engine).match(first, "", 144).num_tokens < 144


@pytest.mark.parametrize("which", ["local", "global"])
def test_a_corrupt_entry_shortens_the_hit_not_the_tokens(
    hybrid_loaded: LoadedModel, which: str
) -> None:
    tokens = prompt(30, 150, hybrid_loaded)
    with spilled(hybrid_loaded, tokens) as engine:
        manager = manager_of(engine)
        digests = manager.block_hashes(tokens, "")
        tier = manager.local_tier if which == "local" else manager.tier
        assert tier is not None
        tier.corrupt_slot(digests[7])  # inside the window of the 144-token hit
        assert manager.match(tokens, "", 149).num_tokens == 144  # the checksum is read later
        ((warm, cached),) = run(engine, [tokens])
        assert same(warm, cold(hybrid_loaded, tokens))
        # local: block 7's page is lost, so the hit is the longest whose window avoids it
        # (112: keys 73..111); global: the reload stops before block 7, and its window too
        assert cached == 112
        assert tier.stats().corrupt == 1
        manager.check_invariants()


def test_every_layer_sliding_keeps_an_index_only_global_tier(
    hybrid_loaded: LoadedModel,
) -> None:
    """Mistral's layout: no global layer, so the global tier stores no bytes, only which
    blocks it holds; the local pages carry all the KV."""
    windows = tuple(40 for _ in hybrid_loaded.config.layer_windows)
    loaded = dataclasses.replace(
        hybrid_loaded, config=dataclasses.replace(hybrid_loaded.config, layer_windows=windows)
    )
    tokens = prompt(40, 130, loaded)
    with spilled(loaded, tokens[:100]) as engine:
        manager = manager_of(engine)
        assert manager.tier is not None and manager.tier.slot_bytes == 0
        ((warm, cached),) = run(engine, [tokens])
        assert cached == 96 and same(warm, cold(loaded, tokens))


def test_the_cache_stats_count_both_parts_of_the_tier(hybrid_loaded: LoadedModel) -> None:
    with spilled(hybrid_loaded, prompt(50, 100, hybrid_loaded)) as engine:
        tier = engine.cache_stats().tier
        manager = manager_of(engine)
        assert manager.tier is not None and manager.local_tier is not None
        g, loc = manager.tier.stats(), manager.local_tier.stats()
        assert tier.used == g.num_entries == 6 and tier.local_used == loc.num_entries == 6
        assert tier.bytes_used == g.bytes_used + loc.bytes_used
        assert tier.local_total == int(engine.config.swa_pool_ratio * tier.total)


def test_the_tier_bytes_gauge_counts_both_parts(hybrid_loaded: LoadedModel) -> None:
    from prometheus_client import generate_latest

    with spilled(hybrid_loaded, prompt(51, 100, hybrid_loaded)) as engine:
        manager = manager_of(engine)
        assert manager.tier is not None and manager.local_tier is not None
        used = manager.tier.stats().bytes_used + manager.local_tier.stats().bytes_used
        text = generate_latest(engine.metrics.registry).decode()
        line = next(
            x for x in text.splitlines() if x.startswith('prefixcache:kv_tier_bytes{state="used"}')
        )
        assert float(line.split()[-1]) == used > manager.tier.stats().bytes_used


def test_a_full_local_tier_keeps_last_windows_over_a_prompts_interior(
    hybrid_loaded: LoadedModel,
) -> None:
    """Room for 9 blocks and 4 local pages: emptying the pool spills a 150-token prompt's 9
    blocks leaf first, and its interior pages (blocks 0-5, more than a window before its end)
    enter at the cold end of the local part, so the full one drops them, not the window
    (blocks 6-8) that a hit on the prompt reads."""
    probe = make_engine(hybrid_loaded)
    g, loc = probe.kv_cache.global_io.bytes_per_block, probe.kv_cache.local_io.bytes_per_block
    gib = (9 * (g + 0.5 * loc) + 64) / 1024**3
    engine = make_engine(hybrid_loaded, kv_offload=f"host:{gib!r}")
    try:
        manager = manager_of(engine)
        assert manager.tier is not None and manager.local_tier is not None
        assert (manager.tier.stats().num_slots, manager.local_tier.stats().num_slots) == (9, 4)
        tokens = prompt(60, 150, hybrid_loaded)
        run(engine, [tokens], max_tokens=1)
        digests = manager.block_hashes(tokens, "")
        engine.evict_all(keep_tier=True)
        assert all(d in manager.local_tier for d in digests[6:9])
        ((warm, cached),) = run(engine, [tokens])
        assert cached == 144 and same(warm, cold(hybrid_loaded, tokens))
    finally:
        engine.close()


def test_a_disk_tier_keeps_both_parts_in_files_removed_at_close(
    hybrid_loaded: LoadedModel, tmp_path: Path
) -> None:
    tokens = prompt(70, 120, hybrid_loaded)
    with spilled(hybrid_loaded, tokens[:100], f"disk:{tmp_path}:0.05") as engine:
        assert len(list(tmp_path.glob("prefixcache-kv-*.slots"))) == 2
        ((warm, cached),) = run(engine, [tokens])
        assert cached == 96 and same(warm, cold(hybrid_loaded, tokens))
        assert engine.cache_stats().tier.kind == "disk"
    assert not list(tmp_path.glob("prefixcache-kv-*.slots"))


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6))
def test_the_engine_under_pressure_with_a_small_tier(hybrid_loaded: LoadedModel, seed: int) -> None:
    """Requests over four shared documents arriving while others run, in small pools (local
    pressure, preemption), a tier of a few dozen blocks, evictions into it and damaged entries:
    every step keeps the invariants, and the answers sampled are the cold ones."""
    rng = random.Random(seed)
    docs = [prompt(seed + i, rng.randrange(30, 120), hybrid_loaded) for i in range(4)]
    config = {
        "num_blocks": rng.choice([24, 32, 48]),
        "max_num_seqs": rng.choice([2, 3, 4]),
        "max_num_batched_tokens": rng.choice([32, 64]),
        "swa_pool_ratio": rng.choice([0.1, 0.3, 0.5]),
    }
    engine = make_engine(hybrid_loaded, kv_offload=f"host:{rng.choice([0.001, 0.003])}", **config)
    manager = manager_of(engine)
    assert manager.tier is not None and manager.local_tier is not None
    prompts: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {}

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            answers.setdefault(out.request_id, []).extend(out.new_token_ids)
        manager.check_invariants()

    try:
        for step in range(300):
            if rng.random() < 0.3 and engine.num_running + engine.num_waiting < 8:
                rid = f"r{step}"
                prompts[rid] = rng.choice(docs) + prompt(rng.randrange(10**6), 20, hybrid_loaded)
                sampling = SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True)
                engine.add_request(EngineRequest(rid, prompts[rid], sampling))
            if rng.random() < 0.05:
                engine.evict_all(keep_tier=rng.random() < 0.9)
            tier = rng.choice([manager.tier, manager.local_tier])
            if rng.random() < 0.05 and len(tier):
                tier.corrupt_slot(rng.choice(list(tier._entries)))
            if engine.has_unfinished:
                collect(engine.step())
        while engine.has_unfinished:
            collect(engine.step())
    finally:
        engine.close()
    event(f"tokens reloaded: {'some' if manager.stats().reloaded_tokens else 'none'}")
    reference = make_engine(hybrid_loaded, enable_prefix_caching=False)
    for rid in rng.sample(sorted(answers), min(6, len(answers))):
        sampling = SamplingParams(max_tokens=len(answers[rid]), ignore_eos=True)
        (cold_out,) = reference.generate([EngineRequest(f"c{rid}", prompts[rid], sampling)])
        assert cold_out.token_ids == answers[rid], rid


def test_the_local_pages_moves_are_counted(hybrid_loaded: LoadedModel) -> None:
    from prometheus_client import generate_latest

    tokens = prompt(52, 150, hybrid_loaded)
    with spilled(hybrid_loaded, tokens) as engine:
        run(engine, [tokens])  # a hit: the window refilled from the tier
        manager = manager_of(engine)
        assert manager.local_tier is not None
        local = manager.local_tier.stats()
        text = generate_latest(engine.metrics.registry).decode()
        for event, value in (("written", local.writes), ("reloaded", local.reloads)):
            line = f'prefixcache:kv_tier_local_pages_total{{event="{event}"}} {float(value)}'
            assert line in text and value > 0, line
    plain = make_engine(hybrid_loaded)  # no tier: no such series
    assert "kv_tier_local_pages" not in generate_latest(plain.metrics.registry).decode()
