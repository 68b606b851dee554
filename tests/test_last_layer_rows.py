"""The last layer takes only the rows whose logits are read past its attention: the logits
and every layer's K/V are those of the full computation."""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache.engine.attention import create_backend
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner


def step(dtype: str, skip: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, KVCache]:
    loaded = load_model("demo", dtype=dtype, device="cpu")
    cache = KVCache(loaded.kv_cache_spec(16), num_blocks=32)
    runner = ModelRunner(loaded, cache, create_backend("torch", "cpu"))
    calls: list[torch.Tensor | None] = []
    forward = type(loaded.model).forward

    def recorded(self, input_ids, positions, attend, out_rows=None):  # type: ignore[no-untyped-def]
        calls.append(out_rows)
        return forward(self, input_ids, positions, attend, out_rows if skip else None)

    monkeypatch.setattr(type(loaded.model), "forward", recorded)
    if not skip:  # the full hidden states, then the logits rows picked as before
        pick = type(loaded.model).compute_logits

        def picked(self, hidden):  # type: ignore[no-untyped-def]
            rows = calls[-1]
            return pick(self, hidden if rows is None else hidden.index_select(0, rows))

        monkeypatch.setattr(type(loaded.model), "compute_logits", picked)
    rng = random.Random(4)
    vocab = loaded.config.vocab_size
    batch = [
        BatchEntry([rng.randrange(3, vocab) for _ in range(40)], 0, [0, 1, 2]),
        BatchEntry([rng.randrange(3, vocab) for _ in range(17)], 0, [3, 4], compute_logits=False),
        BatchEntry([rng.randrange(3, vocab) for _ in range(5)], 0, [5]),
    ]
    logits = runner.execute(batch)
    rows = calls[-1]
    assert rows is not None and rows.numel() == 2  # the runner asked for two rows only
    monkeypatch.undo()
    return logits, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_layer_on_the_logits_rows_only(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    skipped, skipped_cache = step(dtype, True, monkeypatch)
    full, full_cache = step(dtype, False, monkeypatch)
    assert skipped.shape == full.shape == (2, full.shape[1])
    torch.testing.assert_close(skipped, full, atol=1e-4, rtol=1e-4)
    assert skipped.argmax(-1).tolist() == full.argmax(-1).tolist()
    for a, b in zip(skipped_cache.layers, full_cache.layers, strict=True):
        assert torch.equal(a, b)  # K/V of every token, the last layer's included


def test_a_step_without_logits_rows_still_writes_every_layers_kv() -> None:
    loaded = load_model("demo", dtype="float32", device="cpu")
    cache = KVCache(loaded.kv_cache_spec(16), num_blocks=8)
    runner = ModelRunner(loaded, cache, create_backend("torch", "cpu"))
    tokens = list(range(3, 23))
    logits = runner.execute([BatchEntry(tokens, 0, [0, 1], compute_logits=False)])
    assert logits.shape == (0, loaded.config.vocab_size)
    for layer in cache.layers:
        assert layer[:2, :, :, :, :].abs().sum() > 0  # written, last layer too
