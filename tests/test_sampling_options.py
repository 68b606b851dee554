"""vLLM's ``min_p`` and ``min_tokens`` and OpenAI's ``logit_bias``: through the engine (what they
change, and that they are off by default) and through the sidecar (named 400s for values out
of range)."""

from __future__ import annotations

import random

import httpx
import pytest
from conftest import Server

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.request import EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


def generate(loaded: LoadedModel, prompt: list[int], sampling: SamplingParams) -> tuple:
    engine = LLMEngine(EngineConfig(model="demo", dtype="float32", device="cpu"), loaded)
    result = engine.generate([EngineRequest("r", prompt, sampling)])[0]
    return result.token_ids, result.text


def run(loaded: LoadedModel, prompt: list[int], sampling: SamplingParams) -> list[int]:
    return generate(loaded, prompt, sampling)[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_min_p_one_and_top_p_zero_keep_only_the_most_likely_token(
    demo: LoadedModel, seed: int
) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(4, demo.config.vocab_size) for _ in range(20)]
    greedy = run(demo, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    hot = dict(max_tokens=8, ignore_eos=True, temperature=1.5, seed=seed)
    assert run(demo, prompt, SamplingParams(**hot, min_p=1.0)) == greedy
    assert run(demo, prompt, SamplingParams(**hot, top_p=0.0)) == greedy  # OpenAI's range
    sampled = run(demo, prompt, SamplingParams(**hot))
    assert run(demo, prompt, SamplingParams(**hot, min_p=0.0)) == sampled  # off: unchanged
    assert sampled != greedy  # the check above can fail: sampling differs from greedy here


def test_min_tokens_holds_off_stop_ids_eos_and_stop_strings(demo: LoadedModel) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(4, demo.config.vocab_size) for _ in range(20)]
    free = run(demo, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    first = free[0]
    stopped = run(demo, prompt, SamplingParams(max_tokens=6, stop_token_ids=[first]))
    assert stopped == [first]
    held = run(demo, prompt, SamplingParams(max_tokens=6, stop_token_ids=[first], min_tokens=3))
    assert len(held) >= 3 and first not in held[:3]
    assert run(demo, prompt, SamplingParams(max_tokens=6, ignore_eos=True, min_tokens=6)) == free
    _, text = generate(demo, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    stop = text[: max(1, len(text) // 4)]
    cut = generate(demo, prompt, SamplingParams(max_tokens=6, ignore_eos=True, stop=[stop]))
    assert cut[1] == ""  # the stop string begins the text
    longer = SamplingParams(max_tokens=6, ignore_eos=True, stop=[stop], min_tokens=4)
    ids, _ = generate(demo, prompt, longer)
    assert len(ids) >= 4


def test_min_tokens_over_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize(("field", "value"), [("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1)])
def test_out_of_range_values_are_400s(sidecar_server: Server, field: str, value: float) -> None:
    body = {"prompt": "x", "max_tokens": 2, field: value}
    r = httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text


def test_min_tokens_reaches_the_engine(sidecar_server: Server) -> None:
    body = {"prompt": "Say something", "max_tokens": 3, "min_tokens": 3, "temperature": 0}
    out = httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=30).json()
    assert out["usage"]["completion_tokens"] == 3
    body["min_tokens"] = 4  # more than max_tokens: a 400, as vLLM answers
    r = httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=30)
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]


def test_logit_bias_bans_and_forces_greedy_tokens(demo: LoadedModel) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(4, demo.config.vocab_size) for _ in range(20)]
    free = run(demo, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    banned = run(
        demo, prompt, SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={free[0]: -100})
    )
    assert banned[0] != free[0]
    forced_id = (free[0] + 17) % demo.config.vocab_size
    forced = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={forced_id: 100})
    assert run(demo, prompt, forced) == [forced_id] * 4
    nudged = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={forced_id: 0.0})
    assert run(demo, prompt, nudged) == free  # a zero bias changes nothing
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_logit_bias_through_the_server(sidecar_server: Server) -> None:
    (token,) = httpx.post(
        f"{sidecar_server.root}/tokenize", json={"prompt": "hello", "add_special_tokens": False}
    ).json()["tokens"][-1:]
    body = {"prompt": "Say something", "max_tokens": 3, "temperature": 0}
    body["logit_bias"] = {str(token): 100}
    forced = httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=30).json()
    expected = httpx.post(f"{sidecar_server.root}/detokenize", json={"tokens": [token] * 3})
    assert forced["choices"][0]["text"] == expected.json()["prompt"]
    body["logit_bias"] = {str(10**7): 1}
    assert httpx.post(f"{sidecar_server.url}/completions", json=body, timeout=30).status_code == 400
