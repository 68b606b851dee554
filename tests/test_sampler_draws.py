"""Sampled rows: top-p's nucleus found among the most likely tokens equals the one sorting
every probability gives, and the draws follow the kept distribution (temperature, min-p,
top-k, top-p), with no token outside it ever drawn and a non-finite row refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.request import SamplingParams
from prefixcache.engine.step import sampler
from prefixcache.engine.step.sampler import Sampler, draw, nucleus


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """top-p by its definition: every probability sorted, the running mass before each."""
    values, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(values, dim=-1) - values < top_p
    keep[0] = True
    return set(order[keep].tolist())


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(1, 3000),
    spread=st.floats(0.1, 8.0),
    top_p=st.floats(0.0, 1.0, exclude_max=True),
    candidates=st.sampled_from([1, 2, 7, 1024]),
    seed=st.integers(0, 2**31 - 1),
)
def test_nucleus_equals_the_sorted_definition(
    vocab: int, spread: float, top_p: float, candidates: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * spread
    probs = torch.softmax(logits, dim=-1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "NUCLEUS_CANDIDATES", candidates)
        ids, weights = nucleus(probs, top_p)
    assert set(ids.tolist()) == _sorted_nucleus(probs, top_p)
    assert torch.equal(weights, probs[ids])


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from, written out plainly (full sort, no shortcuts)."""
    scaled = logits.to(torch.float64) / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    if 0 < p.top_k < len(scaled):
        scaled = scaled.masked_fill(
            scaled < torch.sort(scaled, descending=True).values[p.top_k - 1], -math.inf
        )
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        kept = torch.zeros_like(probs, dtype=torch.bool)
        kept[list(_sorted_nucleus(probs, p.top_p))] = True
        probs = probs * kept
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.8, seed=2),
        SamplingParams(temperature=1.3, top_k=5, seed=3),
        SamplingParams(temperature=0.9, min_p=0.05, top_p=0.95, top_k=12, seed=4),
    ],
)
def test_draws_follow_the_kept_distribution(params: SamplingParams) -> None:
    logits = torch.linspace(-3.0, 2.0, 40)[
        torch.randperm(40, generator=torch.Generator().manual_seed(9))
    ]
    expected = _expected(logits, params)
    n = 6000
    s = Sampler()
    counts = torch.zeros(40)
    for _ in range(n):
        counts[s._sample_row(logits, params, "r")] += 1
    assert counts[expected == 0].sum() == 0  # nothing outside what the options keep
    freq = counts / n
    bound = 5 * torch.sqrt(expected * (1 - expected) / n) + 2e-3
    assert torch.all((freq - expected).abs() <= bound), (freq - expected).abs().max()


def test_a_seed_gives_the_same_tokens() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    first, second = Sampler(), Sampler()
    a = [first._sample_row(logits, p, "r") for _ in range(20)]
    b = [second._sample_row(logits, p, "r") for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_draw_never_picks_a_zero_weight_and_refuses_non_finite() -> None:
    weights = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    assert {draw(weights, gen) for _ in range(500)} == {1, 3}
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="sum to"):
            draw(torch.tensor([0.5, bad], dtype=torch.float64), gen)
    with pytest.raises(ValueError, match="sum to"):
        draw(torch.zeros(3, dtype=torch.float64), gen)
