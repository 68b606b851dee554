"""Cascade attention (shared prefix read once, merged by LSE) equals non-cascade attention."""

from __future__ import annotations

import pytest
import torch
from test_attention_torch import BS, run_paged

from prefixcache.engine.attention import AttentionMetadata, CascadeGroup, SeqSpec, plan_step_order
from prefixcache.engine.attention.torch_backend import TorchBackend
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_cascade_equals_non_cascade(hq: int, hk: int) -> None:
    spec = [(70, 1), (64, 1), (100, 1), (64, 1), (90, 1)]
    plain, refs, meta_plain = run_paged(spec, hq, hk, shared_prefix=64, seed=3)
    cascade, _, meta = run_paged(spec, hq, hk, shared_prefix=64, seed=3, enable_cascade=True)
    assert not meta_plain.cascade_groups
    assert len(meta.cascade_groups) == 1 and meta.cascade_groups[0].num_shared_blocks == 4
    for a, b, r in zip(cascade, plain, refs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, r, atol=2e-5, rtol=1e-4)


def test_cascade_groups_need_shared_full_blocks_before_start() -> None:
    shared = [1, 2, 3, 4, 5]
    seqs = [
        SeqSpec(80, 1, [*shared, 6]),  # 5 full blocks cached
        SeqSpec(70, 1, [*shared[:4], 7, 8]),  # shares 4 blocks
        SeqSpec(10, 4, [9]),  # a prefill: never grouped
        SeqSpec(60, 1, [*shared[:4]]),  # only 3 full blocks before start_pos
        SeqSpec(100, 1, [20, 21, 22, 23, 24, 25, 26]),  # alone
    ]
    order, groups = plan_step_order(seqs, BS)
    assert order[0] == 2
    assert groups == [CascadeGroup(3, 5, 4)]
    assert sorted(order[3:5]) == [0, 1] and sorted(order[1:3]) == [3, 4]
    order_off, groups_off = plan_step_order(seqs, BS, enable_cascade=False)
    assert groups_off == [] and sorted(order_off) == [0, 1, 2, 3, 4]


def test_cascade_with_one_member_suffix_of_a_single_token() -> None:
    """Members whose only own token is the one being decoded (start_pos on a block edge)."""
    spec = [(64, 1), (64, 1), (65, 1)]
    plain, refs, _ = run_paged(spec, 8, 4, shared_prefix=64, seed=5)
    cascade, _, meta = run_paged(spec, 8, 4, shared_prefix=64, seed=5, enable_cascade=True)
    assert meta.cascade_groups
    for a, b, r in zip(cascade, plain, refs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, r, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("demo", dtype="float32", device="cpu")


def test_runner_cascade_equals_plain_in_a_mixed_step(loaded: LoadedModel) -> None:
    """Two groups with different shared prefixes, a lone decode and a prefill in one step."""
    cache = KVCache(loaded.kv_cache_spec(BS), num_blocks=64)
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:  # cached KV of the prefixes: random stand-ins
        layer.normal_(0, 0.5, generator=gen)
    group_a = [[0, 1, 2, 3, 4, 10 + i] for i in range(3)]  # 5 shared blocks
    group_b = [[20, 21, 22, 23, 30 + i, 35 + i] for i in range(2)]  # 4 shared blocks
    batch = [BatchEntry([7], 80 + 3 * i, t) for i, t in enumerate(group_a)]
    batch += [BatchEntry([9], 70 + 20 * i, t) for i, t in enumerate(group_b)]
    batch.insert(2, BatchEntry([11], 33, [40, 41, 42]))  # alone
    batch.insert(4, BatchEntry(list(range(5, 25)), 16, [43, 44, 45]))  # a prefill chunk
    backend = TorchBackend()
    plans: list[AttentionMetadata] = []
    runner = ModelRunner(loaded, cache, backend, enable_cascade=True, on_plan=plans.append)
    with_cascade = runner.execute(batch)
    meta = plans[-1]
    assert sorted(g.num_shared_blocks for g in meta.cascade_groups) == [4, 5]
    assert meta.num_prefills == 1 and meta.num_plain_decodes == 1
    runner.enable_cascade = False
    plain = runner.execute(batch)
    torch.testing.assert_close(with_cascade, plain, atol=1e-5, rtol=1e-5)
    assert with_cascade.shape == (len(batch), loaded.config.vocab_size)


def test_short_shared_prefix_is_not_grouped() -> None:
    seqs = [SeqSpec(40, 1, [1, 2, 3]), SeqSpec(40, 1, [1, 2, 4])]  # 2 shared blocks < 4
    assert plan_step_order(seqs, BS)[1] == []
    assert plan_step_order(seqs, BS, min_shared_blocks=2)[1] == [CascadeGroup(0, 2, 2)]


def test_runner_batches_alike_cascade_groups_and_equals_plain(loaded: LoadedModel) -> None:
    """Three groups of 3 members over 4 shared blocks and one of 2 (padded to 3) attend to
    their prefixes in one batched call, a group over 5 shared blocks on its own; all equal
    the plain path."""
    cache = KVCache(loaded.kv_cache_spec(BS), num_blocks=96)
    gen = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        layer.normal_(0, 0.5, generator=gen)
    batch = []
    for g in range(3):
        shared = list(range(10 * g, 10 * g + 4))
        for m in range(3):
            own = [40 + 6 * g + 2 * m, 41 + 6 * g + 2 * m]
            batch.append(BatchEntry([3 + m], 64 + 5 + 7 * m + g, shared + own))
    batch += [
        BatchEntry([5], 64 + 9 * i, [60, 61, 62, 63, 70 + 2 * i, 71 + 2 * i]) for i in range(2)
    ]
    batch += [BatchEntry([6], 85 + i, [80, 81, 82, 83, 84, 86 + i]) for i in range(2)]
    backend = TorchBackend()
    plans: list[AttentionMetadata] = []
    runner = ModelRunner(loaded, cache, backend, enable_cascade=True, on_plan=plans.append)
    with_cascade = runner.execute(batch)
    meta = plans[-1]
    assert len(meta.cascade_groups) == 5
    assert [c.num_groups for c in backend._cascades] == [4, 1]
    assert backend._cascades[0].pad_rows is not None
    runner.enable_cascade = False
    plain = runner.execute(batch)
    torch.testing.assert_close(with_cascade, plain, atol=1e-5, rtol=1e-5)
