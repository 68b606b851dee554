"""The row kernel's key partitions (cpu_row_attention.cpp, kPartKeys): a row's keys are
attended 1,024 at a time from fresh states that are folded in ascending order, so that a long
decode at batch 1 can spread its partitions over threads. A row must come out bitwise the
same whether its partitions ran on one thread or several, alone or among other rows, as a
decode or inside a prefill chunk, and equal to the dense softmax within rounding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import row_kernels

pytestmark = pytest.mark.skipif(
    row_kernels.load_rows() is None,
    reason=f"no batch-invariant CPU kernel here ({row_kernels.row_unavailable_reason()})",
)

BS = 16
PART_KEYS = 1024  # kPartBlocks * kKeyBlock in cpu_row_attention.cpp
SHAPES = [(9, 3, 64), (4, 1, 256), (8, 2, 64), (4, 4, 96)]  # SmolLM2's, Gemma 3's, the bench
# model's heads, and Phi-3 mini's head dim


class Sequences:
    """Sequences of keys in scattered pages of one layer, and their queries."""

    def __init__(
        self, lens: list[int], hk: int, d: int, dtype: torch.dtype, seed: int, bs: int = BS
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-n // bs) for n in lens]
        total = sum(blocks) + 1
        self.kv = torch.randn(total, 2, bs, hk, d, generator=gen).to(dtype)
        order = torch.randperm(total - 1, generator=gen) + 1
        self.tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        at = 0
        for i, nb in enumerate(blocks):
            self.tables[i, :nb] = order[at : at + nb].to(torch.int32)
            at += nb
        self.lens = lens

    def attend(
        self,
        q: torch.Tensor,
        rows: list[int],
        threads: int,
        window: int = 0,
        groups: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Sequence i's last rows[i] queries (q's rows in order) over its keys."""
        qo = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int64)
        kv_lens = torch.tensor(self.lens, dtype=torch.int64)
        scale = q.shape[-1] ** -0.5
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return row_kernels.row_attention(
                q, self.kv, self.tables, qo, kv_lens, scale, groups, window, softcap
            )
        finally:
            torch.set_num_threads(before)

    def first(self) -> Sequences:
        """The first sequence alone, on the same pages."""
        one = object.__new__(Sequences)
        one.kv, one.tables, one.lens = self.kv, self.tables[:1], self.lens[:1]
        return one

    def keys(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.tables[i, : -(-n // BS)].long()
        hk, d = self.kv.shape[-2:]
        return (
            self.kv[pages, 0].reshape(-1, hk, d)[:n].double(),
            self.kv[pages, 1].reshape(-1, hk, d)[:n].double(),
        )


def queries(n: int, hq: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cached=st.integers(0, 4300),
    new=st.sampled_from([1, 2, 3, 40, 64, 300]),  # 64: halves, one a thread; 300: packed once
    window=st.sampled_from([0, 0, 300, 1500]),
    others=st.lists(st.tuples(st.integers(1, 2500), st.integers(1, 60)), max_size=3),
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
    softcap=st.sampled_from([0.0, 0.0, 1.5]),
)
def test_a_row_is_the_same_on_any_threads_in_any_company(
    cached: int,
    new: int,
    window: int,
    others: list[tuple[int, int]],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    seed: int,
    softcap: float,
) -> None:
    hq, hk, d = shape
    n = cached + new
    seqs = Sequences([n, *(c + r for c, r in others)], hk, d, dtype, seed)
    q = queries(new + sum(r for _, r in others), hq, d, dtype, seed + 1)
    mine = q[:new]

    solo = seqs.first()  # alone: few tasks, partitions split where they are unequal
    want = solo.attend(mine, [new], threads=1, window=window, softcap=softcap)
    for threads in (2, 3, 4):
        got = solo.attend(mine, [new], threads=threads, window=window, softcap=softcap)
        assert torch.equal(got, want), f"{threads} threads != 1"

    # Among companions (more tasks than threads: no split), at two threads.
    rows = [new, *(r for _, r in others)]
    batch = seqs.attend(q, rows, threads=2, window=window, softcap=softcap)
    assert torch.equal(batch[:new], want), "among other sequences != alone"

    # The chunk's last row as a decode of its own (its sequence cut after that key).
    for threads in (1, 2):
        got = solo.attend(mine[-1:], [1], threads=threads, window=window, softcap=softcap)
        assert torch.equal(got, want[-1:]), f"decode on {threads} threads != the chunk's row"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize("n", [PART_KEYS - 1, PART_KEYS + 1, 3 * PART_KEYS + 500])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_partitioned_rows_equal_the_dense_softmax(
    shape: tuple[int, int, int], window: int, n: int, softcap: float
) -> None:
    """fp32 decodes over keys that cross partitions, on two threads (split), against a float64
    softmax (scores capped as softcap * tanh(s / softcap) where softcap > 0): within fp32
    rounding. A fold that dropped a partition or skipped its rescale, or a cap applied to
    the wrong value, would be off by far more than the bound."""
    hq, hk, d = shape
    seqs = Sequences([n], hk, d, torch.float32, n)
    q = queries(1, hq, d, torch.float32, n + 1) * 2.0  # peaked softmaxes: rescales matter
    got = seqs.attend(q, [1], threads=2, window=window, softcap=softcap).double()
    k, v = seqs.keys(0, n)
    if window:
        k, v = k[-window:], v[-window:]
    g = hq // hk
    s = torch.einsum("hd,khd->hk", q[0].double(), k.repeat_interleave(g, 1)) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ref = torch.einsum("hk,khd->hd", s.softmax(-1), v.repeat_interleave(g, 1))
    torch.testing.assert_close(got[0], ref, atol=2e-6, rtol=1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared_blocks=st.integers(1, 260),
    tails=st.lists(st.integers(1, 40), min_size=2, max_size=4),
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_a_cascade_groups_decodes_match_their_plain_decodes(
    shared_blocks: int,
    tails: list[int],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Decodes that share leading pages (one task reads the shared keys once, its partitions
    split over threads) equal the same decodes attended one by one."""
    hq, hk, d = shape
    shared = shared_blocks * BS
    seqs = Sequences([shared + t for t in tails], hk, d, dtype, seed)
    seqs.tables[1:, :shared_blocks] = seqs.tables[0, :shared_blocks]
    q = queries(len(tails), hq, d, dtype, seed + 1)
    groups = torch.tensor([[0, len(tails), shared]], dtype=torch.int64)
    plain = seqs.attend(q, [1] * len(tails), threads=1)
    for threads in (1, 2, 3):
        got = seqs.attend(q, [1] * len(tails), threads=threads, groups=groups)
        assert torch.equal(got, plain), f"grouped on {threads} threads != plain"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 700).filter(lambda n: n % BS), min_size=1, max_size=3),
    new=st.sampled_from([1, 2, 5]),
    junk=st.sampled_from([math.nan, math.inf, -math.inf, 3e38]),
    window=st.sampled_from([0, 0, 40, 300]),
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_page_slots_past_a_sequences_end_are_never_seen(
    lens: list[int],
    new: int,
    junk: float,
    window: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    seed: int,
) -> None:
    """The slots of a last page past its sequence's end hold whatever an earlier owner left
    (the decode step on AMX reads whole 16-key tiles from the pages in place), as do pages a
    sliding window has left: NaN, infinities or huge values there change no output bit."""
    hq, hk, d = shape
    seqs = Sequences(lens, hk, d, dtype, seed)
    q = queries(sum(min(new, n) for n in lens), hq, d, dtype, seed + 1)
    rows = [min(new, n) for n in lens]
    clean = seqs.attend(q, rows, threads=2, window=window)
    for i, n in enumerate(lens):
        page = seqs.tables[i, (n - 1) // BS].long()
        seqs.kv[page, :, n % BS :] = junk  # K and V of the unused slots
        if window:  # and pages wholly before the first query's window (a sliding layer's)
            first = max(0, n - rows[i] + 1 - window)
            seqs.kv[seqs.tables[i, : first // BS].long()] = junk
    dirty = seqs.attend(q, rows, threads=2, window=window)
    assert not dirty.isnan().any()
    assert torch.equal(dirty, clean)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 2600),
    bs=st.sampled_from([8, 16, 32, 48]),
    pages=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]),
    window=st.sampled_from([0, 0, 200]),
    shape=st.sampled_from(SHAPES),
    seed=st.integers(0, 2**16),
)
def test_a_decode_row_is_its_chunks_row_at_other_page_sizes(
    n: int, bs: int, pages: torch.dtype, window: int, shape: tuple[int, int, int], seed: int
) -> None:
    """bf16 queries over bf16 pages of 8, 16, 32 or 48 slots (where a 16-key tile lies in one
    page, decode reads K in place on AMX; at 8 it cannot and packs) or fp8 pages (converted
    as each block is packed): a sequence's last row decoded alone equals the same row inside a
    40-row chunk, bit for bit."""
    hq, hk, d = shape
    new = min(40, n)
    seqs = Sequences([n], hk, d, pages, seed, bs=bs)
    q = queries(new, hq, d, torch.bfloat16, seed + 1)
    chunk = seqs.attend(q, [new], threads=2, window=window)
    alone = seqs.attend(q[-1:], [1], threads=2, window=window)
    assert torch.equal(alone, chunk[-1:])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 90])
def test_softcapped_bf16_rows_follow_the_dense_softmax(
    shape: tuple[int, int, int], window: int
) -> None:
    """bf16 prefill rows (the AMX step where the CPU has it, else AVX512_BF16) with Gemma 2's
    softcap, against a float64 reference of the same bf16 inputs: within bf16's rounding of
    P and the output, while the uncapped softmax is far from it."""
    hq, hk, d = shape
    n = 300
    seqs = Sequences([n], hk, d, torch.bfloat16, 7)
    q = queries(n, hq, d, torch.bfloat16, 8) * 3.0  # scores past the cap
    got = seqs.attend(q, [n], threads=2, window=window, softcap=2.0).double()
    k, v = seqs.keys(0, n)
    g = hq // hk
    s = torch.einsum("qhd,khd->hqk", q.double(), k.repeat_interleave(g, 1)) / math.sqrt(d)
    pos = torch.arange(n)
    drop = pos[None, :] > pos[:, None]
    if window:
        drop |= pos[None, :] <= pos[:, None] - window
    for capped, close in ((2.0 * torch.tanh(s / 2.0), True), (s, False)):
        p = capped.masked_fill(drop, -math.inf).softmax(-1)
        ref = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1))
        err = (got - ref).abs().max().item()
        assert (err < 0.03) == close, err
