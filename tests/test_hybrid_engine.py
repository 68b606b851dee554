"""Prefix caching on a hybrid (sliding-window + global) model, end to end: the demo Llama
with every other layer sliding (window 40: two and a half pages), attention by a windowed
reference (tests/hybrid_reference.py). Warm runs give the cold run's greedy tokens, and
report the hit length as cached_tokens."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hybrid_reference import WindowedReferenceBackend

from prefixcache.engine import engine as engine_module
from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.hybrid.manager import HybridBlockManager
from prefixcache.engine.model import demo_model
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.sdk.cache_stats import CacheStats, LocalPageStats

WINDOW = 40


@pytest.fixture(scope="module")
def hybrid_loaded() -> LoadedModel:
    loaded = load_model("demo", dtype="float32", device="cpu")
    n = loaded.config.num_layers
    windows = tuple(WINDOW if i % 2 == 0 else 0 for i in range(n))
    return dataclasses.replace(
        loaded, config=dataclasses.replace(loaded.config, layer_windows=windows)
    )


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "create_backend", lambda *a, **k: WindowedReferenceBackend())


def make_engine(loaded: LoadedModel, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"num_blocks": 64, "max_num_seqs": 4, **overrides}
    config = EngineConfig(model="demo", dtype="float32", device="cpu", **settings)
    engine = LLMEngine(config, loaded)
    local = engine.kv_cache.layers[engine.kv_cache.local_layers[0]]
    for i in engine.kv_cache.local_layers:  # the null page: never read, or the output is NaN
        engine.kv_cache.layers[i][0].fill_(float("nan"))
    assert local.shape[0] == engine.kv_cache.num_local_pages
    return engine


def run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 5
) -> list[tuple[list[tuple[int, float]], int]]:
    """One request at a time, to completion: ((token, logprob) generated, cached_tokens)."""
    results = []
    for i, prompt in enumerate(prompts):
        rid = f"r{engine.scheduler.num_steps}-{i}"
        engine.add_request(
            EngineRequest(
                rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
            )
        )
        tokens: list[tuple[int, float]] = []
        cached = -1
        while engine.has_unfinished:
            for out in engine.step():
                assert out.logprobs is not None
                tokens.extend((lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs)
                if out.finished:
                    cached = out.usage.cached_tokens
            engine.block_manager.check_invariants()
        results.append((tokens, cached))
    return results


CORPUS = (Path(demo_model.__file__).parent / "demo_assets" / "corpus.txt").read_text()


def prompt(seed: int, n: int, loaded: LoadedModel) -> list[int]:
    """n tokens of the demo corpus (text the demo model predicts), from a seeded offset."""
    rng = random.Random(seed)
    ids = loaded.tokenizer.encode(CORPUS[:20000])
    start = rng.randrange(0, len(ids) - n)
    return ids[start : start + n]


def test_warm_equals_cold_and_reports_the_hit(hybrid_loaded: LoadedModel) -> None:
    base = prompt(1, 150, hybrid_loaded)
    branch = base[:101] + prompt(2, 30, hybrid_loaded)  # diverges inside a block: copy-on-write
    engine = make_engine(hybrid_loaded, max_num_batched_tokens=64)  # chunked prefill too
    assert isinstance(engine.block_manager, HybridBlockManager)
    (cold_base, c0), (warm_base, c1), (warm_branch, c2) = run(engine, [base, base, branch])
    assert c0 == 0 and c1 == 144 and c2 == 101  # 144: the full blocks (150 + 4 written)
    assert warm_base == cold_base
    ((cold_branch, c3),) = run(make_engine(hybrid_loaded, enable_prefix_caching=False), [branch])
    assert c3 == 0 and warm_branch == cold_branch
    stats = engine.block_manager.stats()
    assert stats.num_local_pages > 0 and stats.num_local_held == 0 and stats.num_local_idle > 0


def test_the_window_matters(hybrid_loaded: LoadedModel) -> None:
    """The sliding layers really slide: a full-attention run of the same model differs."""
    long = prompt(3, 120, hybrid_loaded)
    ((hybrid, _),) = run(make_engine(hybrid_loaded), [long], max_tokens=8)
    full = load_model("demo", dtype="float32", device="cpu")
    ((plain, _),) = run_plain(full, long)
    assert hybrid != plain


def run_plain(loaded: LoadedModel, tokens: list[int]) -> list[tuple[list[int], int]]:
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=64)
    return run(LLMEngine(config, loaded), [tokens], max_tokens=8)


def test_incomplete_window_shrinks_the_hit(hybrid_loaded: LoadedModel) -> None:
    """Detach the local page of a block inside the hit's window: the hit stops before it."""
    base = prompt(4, 150, hybrid_loaded)
    engine = make_engine(hybrid_loaded)
    ((cold, _),) = run(engine, [base])
    manager = engine.block_manager
    assert isinstance(manager, HybridBlockManager)
    blocks = manager.match(base, "", len(base) - 1).blocks
    assert len(blocks) == 9
    local = manager.local
    victim = blocks[7]  # keys 112..127: inside the window of a 149-token hit
    page = local.page_of[victim]
    local._unidle(page)  # what local-pool pressure does to an idle page
    local.block_of[page], local.page_of[victim] = -1, 0
    local._free.append(page)
    manager.check_invariants()
    m = manager.match(base, "", len(base) - 1)
    assert m.num_tokens == 7 * 16  # 112: its window (73..111) is complete
    ((warm, cached),) = run(engine, [base])
    assert cached == 112 and warm == cold


def test_a_backend_without_windows_is_refused(
    hybrid_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixcache.engine.attention.torch_backend import TorchBackend

    class FullOnly(TorchBackend):  # a backend that never learnt AttentionMetadata.window
        supports_window = False

    monkeypatch.setattr(engine_module, "create_backend", lambda *a, **k: FullOnly())
    with pytest.raises(ValueError, match="sliding-window support"):
        LLMEngine(
            EngineConfig(
                model="demo",
                dtype="float32",
                device="cpu",
                attention_backend="torch",
                num_blocks=64,
            ),
            hybrid_loaded,
        )


def run_batch(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, Any]:
    """All at once (batched, chunked, preempted as the pools allow)."""
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
        engine.add_request(EngineRequest(f"b{i}", p, sampling))
    got: dict[str, Any] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.logprobs is not None
            got.setdefault(out.request_id, []).extend(
                (lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs
            )
        engine.block_manager.check_invariants()
    return got


def test_a_burst_under_local_pressure_matches_the_uncached_run(hybrid_loaded: LoadedModel) -> None:
    """Shared prefixes, repeats and divergences at once, with the local pool at its floor:
    idle local pages are detached, hits shrink, commits dedupe; tokens and logprobs are
    those of an engine without caching."""
    base, other, third = (prompt(s, n, hybrid_loaded) for s, n in ((5, 150), (6, 140), (7, 120)))
    prompts = [base, base[:60] + other[:20], third, other, base[:77] + other[:9], other + base[:30]]
    small = {"max_num_batched_tokens": 48, "swa_pool_ratio": 0.01}
    engine = make_engine(hybrid_loaded, **small)
    manager = engine.block_manager
    assert isinstance(manager, HybridBlockManager)
    assert manager.local.num_pages < 40  # the floor: 4 windows + one step
    first = run_batch(engine, prompts)
    second = run_batch(engine, prompts[::-1])
    plain = run_batch(make_engine(hybrid_loaded, enable_prefix_caching=False, **small), prompts)
    assert first == plain
    assert [second[f"b{len(prompts) - 1 - i}"] for i in range(len(prompts))] == [
        plain[f"b{i}"] for i in range(len(prompts))
    ]
    assert manager.stats().hit_tokens > 0
    assert manager.local.num_detached > 0 and manager.shrunk_tokens > 0  # pressure did bite


def test_local_pool_occupancy_is_exported(hybrid_loaded: LoadedModel) -> None:
    from prometheus_client import generate_latest

    engine = make_engine(hybrid_loaded)
    run(engine, [prompt(8, 100, hybrid_loaded)])
    text = generate_latest(engine.metrics.registry).decode()
    local = engine.block_manager.stats()
    assert f'prefixcache:kv_local_pages{{state="idle"}} {float(local.num_local_idle)}' in text
    assert 'prefixcache:kv_local_pages{state="held"} 0.0' in text
    plain = LLMEngine(EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=64))
    assert "kv_local_pages" not in generate_latest(plain.metrics.registry).decode()
    # GET /v1/cache/stats: the same pool, through the SDK's shape (absent when not hybrid)
    stats = msgspec.json.decode(msgspec.json.encode(engine.cache_stats()), type=CacheStats)
    assert stats.local_pages == LocalPageStats(
        total=engine.kv_cache.num_local_pages - 1,
        held=0,
        idle=local.num_local_idle,
        free=engine.block_manager.local.num_free,
    )
    assert local.num_local_idle > 0
    assert b"local_pages" not in msgspec.json.encode(plain.cache_stats())


def test_a_hit_cut_by_its_window_is_explained(hybrid_loaded: LoadedModel) -> None:
    base = prompt(9, 150, hybrid_loaded)
    engine = make_engine(hybrid_loaded)
    run(engine, [base])
    manager = engine.block_manager
    assert isinstance(manager, HybridBlockManager)
    for block in manager.match(base, "", len(base) - 1).blocks[4:]:  # idle: detach them
        local = manager.local
        page = local.page_of[block]
        local._unidle(page)
        local.block_of[page], local.page_of[block] = -1, 0
        local._free.append(page)
    match = manager.match(base, "", len(base) - 1)
    assert match.num_tokens == 4 * 16
    from prefixcache.engine.step.sequence import Sequence

    seq = Sequence(EngineRequest("x", base), list(base), len(base), 0, 0, 0.0)
    miss = engine.activity.on_admit(seq, match)
    assert miss is not None and miss.reason == "window"
