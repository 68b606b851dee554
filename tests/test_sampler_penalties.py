"""Presence, frequency and repetition penalties: the math, and what they do to generation."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.step.sampler import Sampler, apply_penalties


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]):
    """The definitions, one token at a time (vLLM's order: repetition, then the OpenAI two)."""
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition"),
    [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (-0.4, 0.3, 0.8), (1.0, -1.0, 2.0)],
)
def test_penalties_match_their_definitions(presence, frequency, repetition) -> None:
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(50, generator=gen)
    prompt, output = [1, 2, 2, 7], [7, 7, 9, 30, 9, 7]
    p = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition
    )
    expected = reference(row.tolist(), p, prompt, output)
    apply_penalties(row, p, (prompt, output))
    torch.testing.assert_close(row, torch.tensor(expected))


def test_unpenalized_rows_and_logprobs_are_untouched() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    plain = SamplingParams()
    penalized = SamplingParams(frequency_penalty=2.0, logprobs=1)
    histories = [((), (1, 1, 1)), ((), (1, 1, 1))]
    tokens, logprobs, _ = Sampler().sample(logits, [plain, penalized], ["a", "b"], histories)
    assert tokens == [1, 2]  # 5 - 2*3 = -1 < 1: the penalized row moves on
    assert logprobs[1] is not None  # the model's own distribution, before penalties
    assert logprobs[1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[2]))
    assert torch.equal(logits, torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]]))


def test_out_of_range_penalties_are_refused() -> None:
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_frequency_penalty_breaks_a_greedy_loop(demo_loaded) -> None:
    engine = LLMEngine(
        EngineConfig(model="demo", dtype="float32", device="cpu", num_blocks=64), demo_loaded
    )
    prompt = demo_loaded.tokenizer.encode("Hello there, how are you?")

    def run(**penalties: float) -> list[int]:
        sampling = SamplingParams(max_tokens=24, ignore_eos=True, **penalties)
        return engine.generate([EngineRequest(str(penalties), prompt, sampling)])[0].token_ids

    plain = run()
    assert len(set(plain)) <= 2  # the random demo model repeats itself greedily
    penalized = run(frequency_penalty=2.0)
    assert len(set(penalized)) > len(set(plain))
    assert max(penalized.count(t) for t in set(penalized)) < max(plain.count(t) for t in plain)
    assert run(frequency_penalty=2.0) == penalized  # deterministic, and the cache changes nothing
