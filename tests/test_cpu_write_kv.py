"""The row kernel's KV write (``row_kernels.write_kv``) puts every token's K and V where
torch's ``index_copy_`` does, from strided views of a QKV output, and refuses a row outside
the pages before writing anything."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import backend, row_kernels

pytestmark = pytest.mark.skipif(
    row_kernels.load_rows() is None,
    reason=f"no row kernel here ({row_kernels.row_unavailable_reason()})",
)
BS = 16


def torch_write(kv: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    num_blocks, _, bs, hk, d = kv.shape
    flat = kv.view(num_blocks * 2 * bs, hk, d)
    flat.index_copy_(0, rows, k)
    flat.index_copy_(0, rows + bs, v)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 40),
    hq=st.integers(1, 6),
    hk=st.integers(1, 3),
    d=st.sampled_from([32, 64, 80, 256]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_write_kv_matches_index_copy(
    tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 8
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen).to(dtype)
    _, k, v = qkv.view(tokens, hq + 2 * hk, d).split((hq, hk, hk), dim=1)
    # distinct (block, slot) places, as a step's tokens have
    places = torch.randperm(num_blocks * BS, generator=gen)[:tokens]
    rows = (places // BS) * (2 * BS) + places % BS
    got = torch.randn(num_blocks, 2, BS, hk, d, generator=gen).to(dtype)
    want = got.clone()
    assert row_kernels.write_kv(got, rows, k, v)
    torch_write(want, rows, k, v)
    assert torch.equal(got, want)


def test_a_row_outside_the_pages_or_not_a_k_row_is_refused_and_nothing_written() -> None:
    kv = torch.zeros(2, 2, BS, 1, 32)
    k = v = torch.ones(2, 1, 32)
    last_k_row = 2 * 2 * BS - BS  # block 1's V starts here: K rows end one below
    with pytest.raises(ValueError, match="a K row inside the layer's pages"):
        row_kernels.write_kv(kv, torch.tensor([0, last_k_row]), k, v)
    assert not kv.any()
    with pytest.raises(ValueError, match="a K row inside the layer's pages"):
        row_kernels.write_kv(kv, torch.tensor([0, -1]), k, v)
    assert not kv.any()
    with pytest.raises(ValueError, match="a K row inside the layer's pages"):
        row_kernels.write_kv(kv, torch.tensor([0, BS]), k, v)  # block 0's first V row
    assert not kv.any()


def test_pages_of_another_dtype_take_torchs_path() -> None:
    """fp8 pages (and k in another dtype) are not the kernel's: backend.write_kv rounds there."""
    kv = torch.zeros(2, 2, BS, 1, 32, dtype=torch.float8_e4m3fn)
    k = v = torch.full((1, 1, 32), 0.3, dtype=torch.bfloat16)
    assert not row_kernels.write_kv(kv, torch.tensor([3]), k, v)
    backend.write_kv(kv, torch.tensor([3]), k, v)
    assert kv.view(-1, 1, 32)[3].float().eq(k.float().to(torch.float8_e4m3fn).float()).all()
