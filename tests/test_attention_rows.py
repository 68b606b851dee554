"""``AttentionBackend.forward_rows``: the last layer attends only the rows whose logits are
read. On the CPU row kernel each kept row is computed alone (a one-row plan over its own
keys); it must be the row ``forward`` computes, to the bit, whatever the step held (prefill
chunks after cached pages, decodes, cascade and prefill groups, a sliding window, a softcap,
fp8 pages, one thread or two), and every token's K/V must still be written."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import (
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    create_backend,
    row_kernels,
)
from prefixcache.engine.attention.cpu_backend import CpuKernelBackend
from prefixcache.engine.attention.metadata import find_prefill_groups, plan_step_order

BS = 16

pytestmark = pytest.mark.skipif(
    row_kernels.load_rows() is None,
    reason=f"no batch-invariant CPU kernel here ({row_kernels.row_unavailable_reason()})",
)


def step(
    rng: random.Random, shape: AttentionShape, window: int, shared: bool
) -> tuple[AttentionMetadata, int]:
    """A step of prefill chunks (some after cached pages) and decodes, in runner order; with
    ``shared``, sequences start with the same cached pages (cascade and prefill groups)."""
    specs, next_page = [], 1  # page 0: the sliding layers' null page, never read
    common = list(range(next_page, next_page + 5)) if shared else []
    next_page += len(common)
    for _ in range(rng.randint(1, 5)):
        cached = rng.choice([0, rng.randint(1, 150)])
        if shared and rng.random() < 0.7:
            cached = len(common) * BS + rng.randint(0, 40)
        new = rng.choice([1, 1, rng.randint(2, 90)])
        total = cached + new
        pages = -(-total // BS)
        lead = common[: min(len(common), cached // BS)] if shared else []
        own = list(range(next_page, next_page + pages - len(lead)))
        next_page += len(own)
        specs.append(SeqSpec(cached, new, lead + own))
    order, groups = plan_step_order(specs, BS, enable_cascade=not window, min_shared_blocks=2)
    ordered = [specs[i] for i in order]
    prefill_groups = [] if window else find_prefill_groups(ordered, BS, min_shared_blocks=2)
    meta = AttentionMetadata.build(
        ordered,
        BS,
        cascade_groups=groups,
        prefill_groups=prefill_groups,
        window=window,
    )
    return meta, next_page


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    heads=st.sampled_from([(4, 1, 256), (9, 3, 64), (8, 2, 128), (4, 4, 96)]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    pages=st.sampled_from([None, torch.float8_e4m3fn]),
    window=st.sampled_from([0, 0, 24, 64]),
    softcap=st.sampled_from([0.0, 0.0, 30.0]),
    threads=st.sampled_from([1, 2]),
)
def test_kept_rows_are_the_rows_forward_computes(
    seed: int,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    pages: torch.dtype | None,
    window: int,
    softcap: float,
    threads: int,
) -> None:
    rng = random.Random(seed)
    hq, hk, d = heads
    shape = AttentionShape(hq, hk, d, dtype, pages, softcap)
    meta, num_pages = step(rng, shape, window, shared=not window and rng.random() < 0.6)
    t = meta.num_tokens
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hk, d, generator=gen).to(dtype)
    v = torch.randn(t, hk, d, generator=gen).to(dtype)
    cache = torch.randn(num_pages, 2, BS, hk, d, generator=gen).to(shape.page_dtype)
    # The kept rows: each sequence's last (the runner's logits rows), or any rows at all.
    last = (meta.qo_indptr[1:] - 1).tolist()
    kept = [r for r in last if rng.random() < 0.8]
    if rng.random() < 0.3:
        kept = rng.sample(range(t), rng.randint(0, min(t, 12)))
    rows = torch.tensor(kept, dtype=torch.int64)

    backend = create_backend("cpu", "cpu")
    assert isinstance(backend, CpuKernelBackend)
    backend.prepare(shape, torch.device("cpu"))
    assert backend.batch_invariant
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        backend.plan(meta, shape)
        full_cache = cache.clone()
        full = backend.forward(q, k, v, full_cache)
        backend.plan(meta, shape)
        kept_cache = cache.clone()
        out = backend.forward_rows(q, k, v, kept_cache, rows)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (len(kept), hq, d)
    assert torch.equal(out, full.index_select(0, rows))  # to the bit
    assert torch.equal(kept_cache.view(torch.uint8), full_cache.view(torch.uint8))


def test_no_kept_rows_write_kv_alone() -> None:
    """A chunk that samples nothing: its last layer writes K/V and attends no row; the torch
    reference and the split backend do the same."""
    shape = AttentionShape(4, 1, 64, torch.float32)
    meta = AttentionMetadata.build([SeqSpec(20, 30, [1, 2, 3, 4])], BS)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, h, 64, generator=gen) for h in (4, 1, 1))
    none = torch.empty(0, dtype=torch.int64)
    caches = []
    for name in ("cpu", "torch", "cpu-split"):
        backend = create_backend(name, "cpu")
        backend.prepare(shape, torch.device("cpu"))
        backend.plan(meta, shape)
        cache = torch.zeros(5, 2, BS, 1, 64)
        assert backend.forward_rows(q, k, v, cache, none).shape == (0, 4, 64)
        caches.append(cache)
        written = cache[[2, 3, 4]].transpose(0, 1).reshape(2, 3 * BS, 1, 64)[:, 4:34]
        assert torch.equal(written[0], k) and torch.equal(written[1], v)
    assert all(torch.equal(caches[0], c) for c in caches[1:])
