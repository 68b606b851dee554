"""AsyncEngine: concurrent submits, abort while iterating, the event loop stays free."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.request import EngineRequest, GrammarSpec, SamplingParams
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


async def wait_idle(engine: AsyncEngine, timeout: float = 60) -> None:
    """Until nothing runs and no block is in use. The timeout bounds a hang only; whether a
    request was aborted is told by its token count (``generated``), not by how soon the
    blocks came back, which a loaded box stretches."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.num_running or engine.cache_stats().blocks.in_use:
        if asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.02)


def generated(engine: AsyncEngine) -> float:
    """Tokens this engine generated so far (each test has its own engine)."""
    return engine.registry.get_sample_value("prefixcache:generation_tokens_total") or 0.0


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
    await wait_idle(engine)
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.cache_stats().blocks.in_use == 0
    assert generated(engine) < 500, "not aborted: the request ran for all its 500 tokens"


async def test_cancelled_consumer_aborts_request(engine, loaded) -> None:
    request = EngineRequest(
        "cancel-me", prompt(4, 30, loaded.config.vocab_size), SamplingParams(500, ignore_eos=True)
    )
    task = asyncio.create_task(collect(engine, request))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    assert engine.cache_stats().blocks.in_use == 0
    assert generated(engine) < 500, "not aborted: the request ran for all its 500 tokens"


async def test_event_loop_stays_responsive_during_generation(engine, loaded) -> None:
    """The model steps on the engine thread, and the event loop runs while a step does.

    No wall-clock bound: on a loaded box every tick stretches (a tick count against elapsed
    time flaked at load 7.5). Instead each step is watched: the thread it ran on (the failure:
    the model ran on the event loop's thread), and how far a ticker on the loop got while the
    model ran (the failure: the loop waits for the step, e.g. on a lock the step holds). The
    ticker yields at every turn, so any stretch of the step in which the loop holds the GIL
    shows: thousands of ticks in each step here, so a step the loop sat out now and then (the
    loop's thread off the CPU under load) is allowed, most steps are not."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    loop_thread = threading.get_ident()
    core = engine.engine
    real_step = core.step
    threads: set[int] = set()
    during: list[int] = []

    def watched_step():
        threads.add(threading.get_ident())
        before = ticks
        try:
            return real_step()
        finally:
            during.append(ticks - before)

    core.step = watched_step
    task = asyncio.create_task(ticker())
    try:
        tokens, final = await collect(
            engine,
            EngineRequest(
                "busy",
                prompt(5, 400, loaded.config.vocab_size),
                SamplingParams(20, ignore_eos=True),
            ),
        )
    finally:
        task.cancel()
        del core.step  # the class's method again
    assert len(tokens) == 20 and final.finished
    assert during, "no step was watched"
    assert loop_thread not in threads, "the model ran on the event loop"
    print(f"loop ticks during each step: {during}")  # thousands each, two busy loops beside
    ran = sum(n > 0 for n in during)
    assert ran >= len(during) / 2, f"the loop stood still through most steps: {during}"


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


def slow_compiles(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, seconds: float) -> list:
    """Every grammar compile in ``engine`` takes ``seconds`` more; returns when each ended."""
    structured = engine.engine.structured
    checked = structured._checked
    ended: list[float] = []

    def slow(spec: GrammarSpec) -> str:
        time.sleep(seconds)
        grammar = checked(spec)
        ended.append(time.monotonic())
        return grammar

    monkeypatch.setattr(structured, "_checked", slow)
    return ended


async def test_a_grammar_compiles_off_the_step_loop(engine, loaded, monkeypatch) -> None:
    """A constrained request's grammar compiles on a worker thread: a request that came after
    it is served meanwhile (a big schema held every running request's steps up to a second);
    the constrained one runs once its grammar is ready, and a second one takes it cached."""
    pytest.importorskip("llguidance")
    ended = slow_compiles(engine, monkeypatch, 3.0)  # many steps of the plain one, loaded box too
    vocab = loaded.config.vocab_size
    constrained = SamplingParams(16, grammar=GrammarSpec("json"))
    finished: dict[str, float] = {}

    async def timed(request: EngineRequest):
        result = await collect(engine, request)
        finished[request.request_id] = time.monotonic()
        return result

    first = asyncio.ensure_future(timed(EngineRequest("json", prompt(7, 20, vocab), constrained)))
    await asyncio.sleep(0)  # its Add goes in first
    plain = await timed(EngineRequest("plain", prompt(8, 20, vocab), SamplingParams(4)))
    (_, final) = await first
    assert plain[1].finished and final.finished and len(ended) == 1
    assert finished["plain"] < ended[0] <= finished["json"]
    again = await collect(engine, EngineRequest("json2", prompt(9, 20, vocab), constrained))
    assert again[1].finished and len(ended) == 1  # cached: no second compile


async def test_a_request_aborted_while_its_grammar_compiles_never_runs(
    engine, loaded, monkeypatch
) -> None:
    pytest.importorskip("llguidance")
    ended = slow_compiles(engine, monkeypatch, 0.5)
    request = EngineRequest(
        "gone",
        prompt(10, 20, loaded.config.vocab_size),
        SamplingParams(8, grammar=GrammarSpec("json")),
    )
    consumer = asyncio.ensure_future(collect(engine, request))
    await asyncio.sleep(0.1)
    consumer.cancel()  # the client left: an Abort while the grammar compiles
    with pytest.raises(asyncio.CancelledError):
        await consumer
    while not ended:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # the Add came back and was dropped
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert generated(engine) == 0
