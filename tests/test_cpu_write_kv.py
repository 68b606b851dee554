"""The row kernel's KV write (``row_kernels.write_kv``) puts every token's K and V where
torch's ``index_copy_`` does, from strided views of a QKV output, rounds to fp8 pages as
``kv_dtype.to_kv`` does (every bf16 value, random fp32 ones), and refuses a row outside the
pages before writing anything."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import backend, kv_dtype, row_kernels

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


def test_k_in_another_dtype_than_bf16_pages_takes_torchs_path() -> None:
    """k in fp32 over bf16 pages is not the kernel's: backend.write_kv casts there."""
    kv = torch.zeros(2, 2, BS, 1, 32, dtype=torch.bfloat16)
    k = v = torch.full((1, 1, 32), 0.3, dtype=torch.float32)
    assert not row_kernels.write_kv(kv, torch.tensor([3]), k, v)
    backend.write_kv(kv, torch.tensor([3]), k, v)
    assert kv.view(-1, 1, 32)[3].eq(k.to(torch.bfloat16)).all()


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bytes, but for a NaN's sign: torch's own scalar and vector casts disagree on
    it (a long tensor's clamp gives x86's default NaN, negative; a short one keeps the sign)."""
    nan = got.float().isnan()
    assert torch.equal(nan, want.float().isnan())
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


@pytest.mark.parametrize("page_dtype", FP8)
def test_fp8_pages_round_every_bf16_value_as_to_kv(page_dtype: torch.dtype) -> None:
    """All 65,536 bf16 bit patterns (NaNs, infinities, subnormals, the values past the format's
    range) written to fp8 pages: the bytes torch's ``kv_dtype.to_kv`` gives."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    d = 64
    k = every.view(-1, 1, d)  # 1,024 tokens, one head
    v = (-every).view(-1, 1, d)
    t = k.shape[0]
    kv = torch.zeros(t // BS, 2, BS, 1, d, dtype=page_dtype)
    rows = torch.arange(t) // BS * (2 * BS) + torch.arange(t) % BS
    assert row_kernels.write_kv(kv, rows, k, v)
    want = torch.zeros_like(kv)
    flat = want.view(-1, 1, d).view(torch.uint8)
    flat.index_copy_(0, rows, kv_dtype.to_kv(k, page_dtype).view(torch.uint8))
    flat.index_copy_(0, rows + BS, kv_dtype.to_kv(v, page_dtype).view(torch.uint8))
    assert_same_fp8(kv, want)


@settings(max_examples=30, deadline=None)
@given(
    page_dtype=st.sampled_from(FP8),
    exponent=st.integers(-30, 20),
    seed=st.integers(0, 2**16),
)
def test_fp8_pages_round_fp32_values_as_to_kv(
    page_dtype: torch.dtype, exponent: int, seed: int
) -> None:
    """fp32 k and v (every mantissa bit in play) at scales from fp8's subnormals past its
    range: the same bytes as ``to_kv``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(BS, 2, 32, generator=gen) * 2.0**exponent
    v = torch.randn(BS, 2, 32, generator=gen) * 2.0**exponent
    kv = torch.zeros(2, 2, BS, 2, 32, dtype=page_dtype)
    rows = torch.arange(BS) + 2 * BS  # block 1
    assert row_kernels.write_kv(kv, rows, k, v)
    assert_same_fp8(kv[1, 0], kv_dtype.to_kv(k, page_dtype))
    assert_same_fp8(kv[1, 1], kv_dtype.to_kv(v, page_dtype))
    assert not kv[0].view(torch.uint8).any()
