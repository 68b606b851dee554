"""The KV tier's reload path on a real pool (``KVCache``), fp32 and bf16, host and disk slots:
each slot verified in place and copied straight into its page (no gather, no torch op on the
CPU); the bytes that come back are the bytes that went out; a damaged slot stops the reload
there and leaves the pages after it untouched. The speed itself is a bench figure
(``bench/tiers.py --parts 4``, docs/benchmarks.md), not a timing assertion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prefixcache.engine.memory.kv_cache import KVCache, KVCacheSpec
from prefixcache.engine.memory.kv_tier import DiskSlots, HostSlots, KVTier, SlotStorage

DTYPES = [torch.float32, torch.bfloat16]


def pool(dtype: torch.dtype, num_blocks: int = 24) -> KVCache:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = KVCache(spec, num_blocks)
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
    return cache


def page(cache: KVCache, block: int) -> list[torch.Tensor]:
    return [layer[block].clone() for layer in cache.layers]


def storage(kind: str, cache: KVCache, tmp_path: Path) -> SlotStorage:
    if kind == "host":
        return HostSlots(16, cache.bytes_per_block, pin_memory=False)
    return DiskSlots(16, cache.bytes_per_block, str(tmp_path), keep=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pages_read_as_bytes_write_back_from_rows_or_an_array(dtype: torch.dtype) -> None:
    cache = pool(dtype)
    want = [page(cache, b) for b in (3, 7, 1)]
    data = cache.read_pages([3, 7, 1])
    assert data.dtype == np.uint8 and data.shape == (3, cache.bytes_per_block)
    flat = torch.cat([torch.stack(p).flatten(1) for p in zip(*want, strict=True)], 1)
    assert np.array_equal(data, flat.view(torch.uint8).numpy())
    cache.write_pages([10, 12, 11], list(data))  # one row (a view) per page
    cache.write_pages([20, 21, 22], data)  # or the array itself
    for dst in ([10, 12, 11], [20, 21, 22]):
        for block, expected in zip(dst, want, strict=True):
            for got, exp in zip(page(cache, block), expected, strict=True):
                assert torch.equal(got, exp)


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_reload_gives_back_the_spilled_kv_without_a_torch_copy_op(
    kind: str, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = pool(dtype)
    tier = KVTier(storage(kind, cache, tmp_path), cache, writer=True)
    digests = [bytes([i]) * 32 for i in range(5)]
    want = [page(cache, b) for b in range(5)]
    for i, digest in enumerate(digests):
        assert tier.spill(digest, b"", b"", i)
    cache.layers[0].zero_()  # the pool forgets (a reload must not read the old pages)

    def no_torch_op(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CPU reload copies bytes, on this thread, without torch ops")

    monkeypatch.setattr(torch.Tensor, "index_copy_", no_torch_op)
    targets = [17, 9, 23, 4, 12]  # any free pages, in no order
    assert tier.reload(digests, targets) == 5
    monkeypatch.undo()
    for block, expected in zip(targets, want, strict=True):
        for got, exp in zip(page(cache, block), expected, strict=True):
            assert torch.equal(got, exp)
    assert tier.stats().reloads == 5
    tier.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_damaged_slot_stops_the_reload_there(kind: str, tmp_path: Path) -> None:
    cache = pool(torch.float32)
    tier = KVTier(storage(kind, cache, tmp_path), cache, writer=False)
    digests = [bytes([i]) * 32 for i in range(4)]
    for i, digest in enumerate(digests):
        tier.spill(digest, b"", b"", i)
    want = page(cache, 1)
    untouched = page(cache, 18)
    tier.corrupt_slot(digests[2])
    assert tier.reload(digests, [16, 17, 18, 19]) == 2
    assert all(torch.equal(g, e) for g, e in zip(page(cache, 17), want, strict=True))
    assert all(torch.equal(g, e) for g, e in zip(page(cache, 18), untouched, strict=True))
    assert digests[2] not in tier and digests[3] in tier and tier.stats().corrupt == 1
    tier.check()
    tier.close()
