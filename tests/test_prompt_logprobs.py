"""Prompt logprobs (``SamplingParams.prompt_logprobs``, /v1/completions' ``echo``): each prompt
token's logprob from the logits before it, the same bits cold, chunked, batched and with the
prompt already cached (such a request computes its prompt whole and reports no hit), and equal
to the logits of computing each prefix on its own."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import create_backend
from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

BS = 16


@pytest.fixture(scope="module")
def demo_default() -> LoadedModel:
    return load_model("demo", dtype="auto", device="cpu")  # bf16 where the CPU runs it


@pytest.fixture(scope="module")
def demo_fp32() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


def engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    dtype = str(loaded.dtype).removeprefix("torch.")
    config = EngineConfig(model="demo", dtype=dtype, device="cpu", num_blocks=160)
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config, loaded)


def as_tuples(entries: list) -> list:
    return [None if e is None else (e.token_id, e.logprob, e.top) for e in entries]


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31), length=st.integers(2, 200), chunk=st.integers(16, 64),
    top=st.integers(0, 3),
)  # fmt: skip
def test_prompt_logprobs_are_the_same_bits_cold_chunked_cached_and_batched(
    demo_default: LoadedModel, seed: int, length: int, chunk: int, top: int
) -> None:
    rng = random.Random(seed)
    vocab = demo_default.config.vocab_size
    prompt = [rng.randrange(4, vocab) for _ in range(length)]
    others = [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 90))] for _ in range(2)]
    sampling = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=top)

    cold = engine(demo_default).generate([EngineRequest("a", prompt, sampling)])[0]
    assert cold.prompt_logprobs is not None and len(cold.prompt_logprobs) == length
    assert cold.prompt_logprobs[0] is None
    assert [e.token_id for e in cold.prompt_logprobs[1:]] == prompt[1:]
    assert all(len(e.top) == top for e in cold.prompt_logprobs[1:])
    expected = as_tuples(cold.prompt_logprobs)

    chunked = engine(demo_default, max_num_batched_tokens=chunk)
    got = chunked.generate([EngineRequest("b", prompt, sampling)])[0]
    assert as_tuples(got.prompt_logprobs) == expected

    warm = engine(demo_default)
    warm.generate([EngineRequest("c0", prompt, SamplingParams(max_tokens=1))])  # now cached
    got = warm.generate([EngineRequest("c", prompt, sampling)])[0]
    assert got.usage.cached_tokens == 0 and got.usage.computed_prompt_tokens == length
    assert as_tuples(got.prompt_logprobs) == expected
    assert got.token_ids == cold.token_ids

    batched = engine(demo_default, max_num_batched_tokens=chunk)
    requests = [EngineRequest("d", prompt, sampling)]
    requests += [
        EngineRequest(f"o{i}", p, SamplingParams(max_tokens=3)) for i, p in enumerate(others)
    ]
    got = batched.generate(requests)[0]
    assert as_tuples(got.prompt_logprobs) == expected
    # an ordinary request after it still hits the prompt it computed
    after = batched.generate([EngineRequest("e", prompt, SamplingParams(max_tokens=1))])[0]
    assert after.usage.cached_tokens >= (length - 1) // BS * BS


def test_prompt_logprobs_equal_each_prefix_computed_alone(demo_fp32: LoadedModel) -> None:
    rng = random.Random(7)
    vocab = demo_fp32.config.vocab_size
    prompt = [rng.randrange(4, vocab) for _ in range(37)]
    sampling = SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprob_ranks=True)
    out = engine(demo_fp32, max_num_batched_tokens=16).generate(
        [EngineRequest("p", prompt, sampling)]
    )[0]
    runner = ModelRunner(
        demo_fp32,
        KVCache(demo_fp32.kv_cache_spec(BS), num_blocks=8),
        create_backend("torch", "cpu"),
    )
    for p in range(len(prompt) - 1):  # logits at position p, from prefix [0, p] alone
        logits = runner.execute([BatchEntry(prompt[: p + 1], 0, list(range(-(-(p + 1) // BS))))])
        logp = torch.log_softmax(logits[0], dim=-1)
        entry = out.prompt_logprobs[p + 1]
        assert entry.token_id == prompt[p + 1]
        assert entry.logprob == pytest.approx(float(logp[prompt[p + 1]]), abs=1e-4)
        assert entry.top[0][0] == int(logp.argmax())
        # the rank: vocabulary entries at least as likely (the reference's own count, give or
        # take entries within rounding of the token's logprob)
        at = float(logp[prompt[p + 1]])
        assert int((logp >= at + 1e-4).sum()) <= entry.rank - 1
        assert entry.rank <= int((logp >= at - 1e-4).sum())


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
