"""Prefix reuse is exact: computing S over a cached P gives the logits of computing P+S."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.attention import AttentionMetadata, create_backend
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

BS = 16


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


def make_runner(
    loaded: LoadedModel, cascade: bool = True, plans: list[AttentionMetadata] | None = None
) -> ModelRunner:
    """``plans``: where every step's attention metadata goes."""
    cache = KVCache(loaded.kv_cache_spec(BS), num_blocks=128)
    on_plan = plans.append if plans is not None else None
    return ModelRunner(
        loaded, cache, create_backend("torch", "cpu"), enable_cascade=cascade, on_plan=on_plan
    )


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def blocks(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // BS)))


@pytest.mark.parametrize("p_len,s_len", [(32, 9), (37, 20), (5, 1), (48, 1), (50, 40)])
def test_prefill_over_cached_prefix_equals_full_prefill(
    loaded: LoadedModel, p_len: int, s_len: int
) -> None:
    vocab = loaded.config.vocab_size
    p, s = tokens(p_len, 1, vocab), tokens(s_len, 2, vocab)
    runner = make_runner(loaded)
    table = blocks(0, p_len + s_len)
    cold = runner.execute([BatchEntry(p + s, 0, table)])

    runner2 = make_runner(loaded)
    runner2.execute([BatchEntry(p, 0, table[: -(-p_len // BS)], compute_logits=False)])
    warm = runner2.execute([BatchEntry(s, p_len, table)])
    torch.testing.assert_close(warm, cold, atol=1e-5, rtol=1e-5)


def test_copy_on_write_tail_gives_same_logits(loaded: LoadedModel) -> None:
    """A second sequence shares P's full blocks and copies the partial tail block."""
    vocab = loaded.config.vocab_size
    p, s = tokens(41, 3, vocab), tokens(12, 4, vocab)  # P = 2 full blocks + 9 tokens
    runner = make_runner(loaded)
    owner = blocks(0, 41)  # [0, 1, 2]
    runner.execute([BatchEntry(p, 0, owner, compute_logits=False)])
    runner.kv_cache.copy_slots(owner[2], 10, 9)  # copy-on-write of the 9 cached tail tokens
    reuse_table = [owner[0], owner[1], 10, 11]
    warm = runner.execute([BatchEntry(s, 41, reuse_table)])

    cold = make_runner(loaded).execute([BatchEntry(p + s, 0, blocks(20, 53))])
    torch.testing.assert_close(warm, cold, atol=1e-5, rtol=1e-5)
    # The owner's tail block is untouched by the second sequence's writes.
    for layer in runner.kv_cache.layers:
        assert not torch.equal(layer[owner[2], :, 9:], layer[10, :, 9:])


def test_chunked_prefill_and_decode_batch_equal_single_runs(loaded: LoadedModel) -> None:
    """Chunked prefill + mixed batches + cascade decode match one-shot computation."""
    vocab = loaded.config.vocab_size
    shared = tokens(80, 5, vocab)
    plans: list[AttentionMetadata] = []
    runner = make_runner(loaded, plans=plans)
    # Prefill the shared 80 tokens (5 full blocks) in two chunks.
    runner.execute([BatchEntry(shared[:48], 0, [0, 1, 2], compute_logits=False)])
    runner.execute([BatchEntry(shared[48:], 48, [0, 1, 2, 3, 4])])
    tails = [tokens(k, 10 + k, vocab) for k in (3, 7, 1)]
    tables = [[0, 1, 2, 3, 4, 10 + 2 * i, 11 + 2 * i] for i in range(3)]
    runner.execute([BatchEntry(t, 80, tb) for t, tb in zip(tails, tables, strict=True)])
    nxt = [5, 6, 7]
    batch = [BatchEntry([n], 80 + len(t), tb) for n, t, tb in zip(nxt, tails, tables, strict=True)]
    cascade_logits = runner.execute(batch)
    assert plans[-1].cascade_groups
    runner.enable_cascade = False
    plain_logits = runner.execute(batch)
    assert not plans[-1].cascade_groups
    torch.testing.assert_close(cascade_logits, plain_logits, atol=1e-5, rtol=1e-5)
    for i, (t, n) in enumerate(zip(tails, nxt, strict=True)):
        one = make_runner(loaded).execute([BatchEntry(shared + t + [n], 0, blocks(0, 100))])
        torch.testing.assert_close(cascade_logits[i : i + 1], one, atol=1e-5, rtol=1e-5)


def test_logits_rows_follow_batch_order_and_compute_logits(loaded: LoadedModel) -> None:
    vocab = loaded.config.vocab_size
    runner = make_runner(loaded)
    a, b, c = tokens(20, 7, vocab), tokens(1, 8, vocab), tokens(30, 9, vocab)
    out = runner.execute(
        [
            BatchEntry(a, 0, blocks(0, 20)),
            BatchEntry(b, 0, [5]),
            BatchEntry(c, 0, blocks(10, 30), compute_logits=False),
        ]
    )
    assert out.shape == (2, vocab) and out.dtype == torch.float32
    ref_a = make_runner(loaded).execute([BatchEntry(a, 0, blocks(0, 20))])
    ref_b = make_runner(loaded).execute([BatchEntry(b, 0, [0])])
    torch.testing.assert_close(out, torch.cat([ref_a, ref_b]), atol=1e-5, rtol=1e-5)


def test_execute_rejects_bad_entries(loaded: LoadedModel) -> None:
    runner = make_runner(loaded)
    with pytest.raises(ValueError, match="block table"):
        runner.execute([BatchEntry(list(range(20)), 0, [0])])
    with pytest.raises(ValueError, match="at least one token"):
        runner.execute([BatchEntry([], 0, [0])])
    with pytest.raises(ValueError, match="token id out of range"):
        runner.execute([BatchEntry([loaded.config.vocab_size], 0, [0])])
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner.execute([BatchEntry([1], 0, [10_000])])


def test_prefills_after_one_cached_prefix_read_it_once_with_same_logits(
    loaded: LoadedModel,
) -> None:
    """A burst over one cached prefix forms a prefill group; logits equal ungrouped runs."""
    vocab = loaded.config.vocab_size
    shared = tokens(96, 21, vocab)  # 6 full blocks
    plans: list[AttentionMetadata] = []
    runner = make_runner(loaded, plans=plans)
    runner.execute([BatchEntry(shared, 0, blocks(0, 96), compute_logits=False)])
    extra = tokens(16, 22, vocab)  # one member also has its own cached block beyond the prefix
    runner.execute([BatchEntry(extra, 96, [*blocks(0, 96), 6], compute_logits=False)])
    suffixes = [tokens(n, 30 + n, vocab) for n in (5, 17, 9)]
    batch = [
        BatchEntry(suffixes[0], 96, [*blocks(0, 96), 10]),
        BatchEntry(suffixes[1], 112, [*blocks(0, 96), 6, 11, 12]),
        BatchEntry(tokens(12, 40, vocab), 0, [20]),  # unrelated cold prefill, not grouped
        BatchEntry(suffixes[2], 96, [*blocks(0, 96), 13]),
    ]
    grouped = runner.execute(batch)
    meta = plans[-1]
    assert [g.num_shared_blocks for g in meta.prefill_groups] == [6]
    assert meta.prefill_groups[0].end - meta.prefill_groups[0].begin == 3
    runner.enable_cascade = False
    plain = runner.execute(batch)
    assert not plans[-1].prefill_groups
    torch.testing.assert_close(grouped, plain, atol=1e-5, rtol=1e-5)
    one = make_runner(loaded).execute([BatchEntry(shared + extra + suffixes[1], 0, blocks(0, 129))])
    torch.testing.assert_close(grouped[1:2], one, atol=1e-5, rtol=1e-5)
