"""The sampler's greedy pick equals torch.argmax: first maximum, NaN largest, any vocab, on
both of its paths (numpy's argmax for a few rows, the two torch passes past them)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.step import sampler
from prefixcache.engine.step.sampler import first_argmax


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([1, 7, 16, 48, 256, 512, 2203, 4096, 32000]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "-0.0"]), max_size=3),
    numpy_path=st.booleans(),
)
def test_first_argmax_equals_argmax(
    rows: int, vocab: int, seed: int, ties: bool, specials: list[str], numpy_path: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if ties:  # few distinct values: the first maximum must win
        logits = logits.round()
    for special in specials:
        r = int(torch.randint(0, rows, (1,), generator=gen))
        c = int(torch.randint(0, vocab, (1,), generator=gen))
        logits[r, c] = float(special)
    limit = sampler.NUMPY_ARGMAX_MAX_ELEMENTS if numpy_path else 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "NUMPY_ARGMAX_MAX_ELEMENTS", limit)
        assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
