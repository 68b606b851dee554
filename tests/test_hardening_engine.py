"""Regression tests of issue 18's engine defects: sampling numerics, failure isolation, gauges
and failure counts. Each failed on the code before its fix."""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.step.engine_hooks import EngineHooks
from prefixcache.engine.step.sampler import Sampler

# Values validation lets through that overflowed or underflowed float32 in the sampler.
EXTREME = [
    {"temperature": 1e-300},
    {"temperature": 1e-40},
    {"temperature": 1e-300, "top_p": 5e-324},
    {"temperature": 1.0, "top_p": 1e-46},
    {"temperature": 1.0, "top_p": 5e-324},
    {"temperature": 1.0, "repetition_penalty": 1e-300},
    {"temperature": 0.0, "repetition_penalty": 1e-300},
    {"temperature": 2.0, "top_p": 5e-324, "repetition_penalty": 1e-300, "top_k": 3},
]


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo", dtype="float32", device="cpu")


def make_engine(loaded, **overrides) -> LLMEngine:
    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=256, **overrides)
    return LLMEngine(config, loaded)


def prompts(vocab: int, n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def gauge(engine: LLMEngine, name: str, labels: dict | None = None) -> float | None:
    return engine.metrics.registry.get_sample_value(name, labels or {})


@pytest.mark.parametrize("fields", EXTREME, ids=[str(f) for f in EXTREME])
def test_extreme_sampling_values_sample_a_valid_token(fields: dict) -> None:
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 30
    params = [SamplingParams(max_tokens=1, **fields), SamplingParams(), SamplingParams()]
    histories = [((1, 2, 3, 7), (4,)), ((), ()), ((), ())]
    tokens, _, errors = Sampler().sample(logits, params, ["x", "a", "b"], histories)
    assert errors == [None, None, None]
    assert all(0 <= t < vocab for t in tokens)
    assert tokens[1:] == logits[1:].argmax(-1).tolist()
    if fields["temperature"] < 1e-5 or fields.get("top_p", 1) < 1e-30:
        assert tokens[0] == Sampler().sample(logits[:1], params[:1], ["y"], histories[:1])[0][0]


def test_extreme_sampling_values_leave_the_batch_unchanged(loaded) -> None:
    vocab = loaded.config.vocab_size
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    bystanders = prompts(vocab, 8)
    alone = [r.token_ids for r in make_engine(loaded).generate(bystanders, greedy)]
    engine = make_engine(loaded)
    requests = [EngineRequest(f"b{i}", p, greedy) for i, p in enumerate(bystanders)]
    requests += [
        EngineRequest(f"x{i}", bystanders[0][:9], SamplingParams(max_tokens=6, **fields))
        for i, fields in enumerate(EXTREME)
    ]
    results = engine.generate(requests)
    assert [r.token_ids for r in results[:8]] == alone
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results)


def test_a_request_whose_sampling_fails_ends_alone(loaded) -> None:
    vocab = loaded.config.vocab_size
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    bystanders = prompts(vocab, 6, seed=4)
    alone = [r.token_ids for r in make_engine(loaded).generate(bystanders, greedy)]

    def faulty(row, p, request_id):
        if request_id == "bad":
            raise RuntimeError("injected sampling fault")

    config = EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=256)
    engine = LLMEngine(config, loaded, EngineHooks(logits_processors=(faulty,)))
    requests = [EngineRequest(f"b{i}", p, greedy) for i, p in enumerate(bystanders)]
    bad = EngineRequest("bad", bystanders[1], SamplingParams(max_tokens=5, temperature=1.0))
    requests.insert(2, bad)
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error"
    assert "injected sampling fault" in (finals["bad"].error or "")
    assert [tokens[f"b{i}"] for i in range(6)] == alone
    assert gauge(engine, "prefixcache:request_failure_total", {"reason": "request_error"}) == 1
    assert gauge(engine, "prefixcache:request_success_total", {"finished_reason": "abort"}) is None
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_a_failed_model_step_ends_its_batch_counts_failures_and_sets_the_error(
    loaded, monkeypatch
) -> None:
    engine = make_engine(loaded)
    vocab = loaded.config.vocab_size
    for i, p in enumerate(prompts(vocab, 3, seed=5)):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=4)))
    monkeypatch.setattr(engine.runner, "execute", lambda batch: 1 / 0)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"r0", "r1", "r2"}
    assert all(o.finished and o.finish_reason == "error" and o.error for o in outputs)
    assert engine.error is not None and "ZeroDivisionError" in engine.error
    assert gauge(engine, "prefixcache:request_failure_total", {"reason": "engine_error"}) == 3
    assert gauge(engine, "prefixcache:request_success_total", {"finished_reason": "abort"}) is None
    assert gauge(engine, "prefixcache:kv_blocks", {"state": "in_use"}) == 0
    assert gauge(engine, "prefixcache:num_requests_running") == 0
    monkeypatch.undo()  # the model works again: the next good step clears the error
    engine.generate([prompts(vocab, 1, seed=6)[0]], SamplingParams(max_tokens=2))
    assert engine.error is None


def test_gauges_are_true_after_an_abort_mid_prefill(loaded) -> None:
    engine = make_engine(loaded, max_num_batched_tokens=32)
    vocab = loaded.config.vocab_size
    long_prompt = [random.Random(7).randrange(3, vocab) for _ in range(300)]
    engine.add_request(EngineRequest("long", long_prompt, SamplingParams(max_tokens=4)))
    engine.step()  # one chunk of the prefill: blocks held, one request running
    assert gauge(engine, "prefixcache:kv_blocks", {"state": "in_use"}) > 0
    assert gauge(engine, "prefixcache:num_requests_running") == 1
    engine.abort_request("long")  # the client went away mid-prefill; no step follows
    stats = engine.cache_stats()
    assert stats.blocks.in_use == 0
    assert gauge(engine, "prefixcache:kv_blocks", {"state": "in_use"}) == stats.blocks.in_use
    assert gauge(engine, "prefixcache:kv_blocks", {"state": "free"}) == stats.blocks.free
    cached = gauge(engine, "prefixcache:kv_blocks", {"state": "cached_idle"})
    assert cached == stats.blocks.cached_idle
    assert gauge(engine, "prefixcache:num_requests_running") == 0
    assert gauge(engine, "prefixcache:num_requests_waiting") == 0
