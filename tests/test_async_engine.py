"""AsyncEngine: concurrent submits, abort while iterating, the event loop stays free."""

from __future__ import annotations

import asyncio
import random

import pytest

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.serving.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo", dtype="float32", device="cpu")


@pytest.fixture
async def engine(loaded):
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=256)
    engine = AsyncEngine(config, loaded)
    await engine.start()
    yield engine
    await engine.shutdown()


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


async def collect(engine: AsyncEngine, request: EngineRequest):
    tokens, final = [], None
    async for out in engine.generate(request):
        tokens += out.new_token_ids
        final = out
    return tokens, final


async def test_concurrent_submits_match_sequential_results(engine, loaded) -> None:
    vocab = loaded.config.vocab_size
    shared = prompt(0, 40, vocab)
    requests = [
        EngineRequest(f"c{i}", shared + prompt(i + 1, 8, vocab), SamplingParams(5, ignore_eos=True))
        for i in range(6)
    ]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for (tokens, final), request in zip(results, requests, strict=True):
        assert final.finished and final.finish_reason == "length"
        assert len(tokens) == 5 and final.usage.completion_tokens == 5
        alone = engine.engine  # same engine, run the request again on its own
        again, _ = await collect(
            engine,
            EngineRequest(
                request.request_id + "-again", request.prompt_token_ids, request.sampling
            ),
        )
        assert again == tokens
        assert alone.block_manager.num_used_blocks >= 0
    assert sum(final.usage.cached_tokens for _, final in results) >= 5 * 32


async def test_abort_while_iterating_frees_blocks(engine, loaded) -> None:
    request = EngineRequest(
        "long", prompt(3, 60, loaded.config.vocab_size), SamplingParams(500, ignore_eos=True)
    )
    seen = 0
    async for out in engine.generate(request):
        seen += len(out.new_token_ids)
        if seen >= 3:
            break  # the client went away
    for _ in range(100):
        if engine.cache_stats().blocks.in_use == 0 and engine.num_running == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.cache_stats().blocks.in_use == 0


async def test_cancelled_consumer_aborts_request(engine, loaded) -> None:
    request = EngineRequest(
        "cancel-me", prompt(4, 30, loaded.config.vocab_size), SamplingParams(500, ignore_eos=True)
    )
    task = asyncio.create_task(collect(engine, request))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if engine.num_running == 0 and engine.cache_stats().blocks.in_use == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.cache_stats().blocks.in_use == 0


async def test_event_loop_stays_responsive_during_generation(engine, loaded) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    loop = asyncio.get_running_loop()
    start = loop.time()
    await collect(
        engine,
        EngineRequest(
            "busy", prompt(5, 400, loaded.config.vocab_size), SamplingParams(20, ignore_eos=True)
        ),
    )
    elapsed = loop.time() - start
    task.cancel()
    assert ticks >= 0.5 * elapsed / 0.01, "the model ran on the event loop"


async def test_warm_pin_and_stats(engine, loaded) -> None:
    tokens = prompt(6, 64, loaded.config.vocab_size)
    first = await engine.warm(tokens, pin=True)
    assert first.tokens == 64 and first.cached_tokens == 0 and first.pinned_blocks == 4
    again = await engine.warm(tokens)
    assert again.cached_tokens == 63
    assert engine.cache_stats().blocks.pinned == 4
    await engine.evict_all()
    assert engine.cache_stats().blocks.pinned == 4, "evict_all keeps pinned blocks"
    assert await engine.unpin(tokens) == 4
    await engine.evict_all()
    stats = engine.cache_stats()
    assert stats.blocks.pinned == 0 and stats.blocks.cached_idle == 0


async def test_invalid_request_raises_and_leaves_engine_healthy(engine) -> None:
    with pytest.raises(ValueError):
        await collect(engine, EngineRequest("bad", [], SamplingParams(1)))
    tokens, final = await collect(
        engine, EngineRequest("ok", [5, 6, 7], SamplingParams(2, ignore_eos=True))
    )
    assert final.finished and len(tokens) == 2
