"""Sliding-window attention (``AttentionMetadata.window``) in every backend, against a dense
masked reference computed per sequence in float64.

The query at position p attends to keys k with ``p - w < k <= p`` (w keys, itself included).
Steps are drawn by hypothesis: windows from 1 to past the context, random start positions,
chunked prefills (a prefill after cached pages) and decodes, in bf16 and fp32. Pages lying
wholly before every query's window are mapped to the null page (page 0), as the sliding
layers' block tables are; it is filled with the dtype's largest finite value, and then with
NaN: the outputs must not change at all (bitwise), so no backend depends on, or even reads,
those pages. The batch-invariant row kernel keeps its promise with a window: a sequence's
rows are bitwise equal alone and in a batch.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import flashinfer_standin
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    cpu_kernels,
    row_kernels,
)
from prefixcache.engine.attention.cpu_backend import CpuKernelBackend
from prefixcache.engine.attention.flashinfer_backend import FlashInferBackend
from prefixcache.engine.attention.split_backend import SplitKernelBackend
from prefixcache.engine.attention.torch_backend import TorchBackend

BS = 16
NULL_PAGE = 0


def _flashinfer() -> AttentionBackend:
    return FlashInferBackend("cpu", module=flashinfer_standin, workspace_bytes=16)


# name -> (factory, dtypes it runs, kernel available here)
BACKENDS: dict[str, tuple[Callable[[], AttentionBackend], tuple[torch.dtype, ...], bool]] = {
    "torch": (TorchBackend, (torch.bfloat16, torch.float32), True),
    "cpu-rows": (
        CpuKernelBackend,
        (torch.bfloat16, torch.float32),
        row_kernels.load_rows() is not None,
    ),
    "cpu-split": (SplitKernelBackend, (torch.bfloat16,), cpu_kernels.load() is not None),
    "flashinfer-standin": (_flashinfer, (torch.bfloat16, torch.float32), True),
}


@dataclass
class Case:
    seqs: list[SeqSpec]  # prefills first (metadata order)
    window: int
    kv_layer: torch.Tensor  # cached keys written; page 0 is the null page
    q: torch.Tensor
    k: torch.Tensor  # the step's new K/V, rows as q's
    v: torch.Tensor
    full_k: list[torch.Tensor]  # every sequence's keys, [kv_len, Hk, D], in the dtype
    full_v: list[torch.Tensor]
    null_pages: int  # block-table entries mapped to the null page
    softcap: float = 0.0  # > 0: scores capped as softcap * tanh(s / softcap) (Gemma 2)


def first_needed_page(start: int, window: int) -> int:
    """Pages before this one lie wholly before the window of the first query (at ``start``)."""
    return max(0, start - window + 1) // BS


def make_case(
    spec: list[tuple[int, int]],
    window: int,
    hq: int,
    hk: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
) -> Case:
    """``spec``: (start_pos, num_new) per sequence, prefills (num_new > 1) first. A sequence's
    data depends only on its (start_pos, num_new) and ``seed``, not on its companions."""
    rnd = random.Random(seed)
    num_blocks = 1 + sum(-(-(s + n) // BS) for s, n in spec)
    free = list(range(1, num_blocks))
    rnd.shuffle(free)
    kv_layer = torch.zeros(num_blocks, 2, BS, hk, d, dtype=dtype)
    seqs, fk, fv, qs, ks, vs, nulls = [], [], [], [], [], [], 0
    for start, n in spec:
        total = start + n
        gen = torch.Generator().manual_seed(seed * 100_003 + start * 1_009 + n)
        kv = torch.randn(total, 2, hk, d, generator=gen).to(dtype)
        skip = first_needed_page(start, window) if window else 0  # window 0: full attention
        table = [NULL_PAGE] * skip + [free.pop() for _ in range(-(-total // BS) - skip)]
        nulls += skip
        for pos in range(skip * BS, start):  # the cached part in its pages
            kv_layer[table[pos // BS], :, pos % BS] = kv[pos]
        seqs.append(SeqSpec(start, n, table))
        fk.append(kv[:, 0])
        fv.append(kv[:, 1])
        qs.append(torch.randn(n, hq, d, generator=gen).to(dtype))
        ks.append(kv[start:, 0])
        vs.append(kv[start:, 1])
    return Case(seqs, window, kv_layer, torch.cat(qs), torch.cat(ks), torch.cat(vs), fk, fv, nulls)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, softcap: float = 0.0
) -> torch.Tensor:
    """Dense sliding-window causal attention of one sequence in float64: row i (position
    ``Lk - Lq + i``) sees key j iff ``p - window < j <= p`` (every key before it at window
    0); scores capped as ``softcap * tanh(s / softcap)`` where softcap > 0."""
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    kf = k.double().repeat_interleave(hq // hk, dim=1)
    vf = v.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kf) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    drop = (j > p) | ((j <= p - window) if window else torch.zeros_like(j > p))
    return torch.einsum("hqk,khd->qhd", s.masked_fill(drop, -math.inf).softmax(-1), vf)


def run_step(
    backend: AttentionBackend, case: Case, hq: int, hk: int, null_fill: float | None = None
) -> torch.Tensor:
    """The step's output rows; ``null_fill`` fills the null page first."""
    meta = AttentionMetadata.build(case.seqs, BS, "cpu", window=case.window)
    shape = AttentionShape(hq, hk, case.q.shape[2], case.q.dtype, softcap=case.softcap)
    backend.prepare(shape, torch.device("cpu"))
    backend.plan(meta, shape)
    layer = case.kv_layer.clone()
    if null_fill is not None:
        layer[NULL_PAGE] = null_fill
    return backend.forward(case.q.clone(), case.k, case.v, layer)


def check_against_reference(out: torch.Tensor, case: Case) -> None:
    row = 0
    for i, s in enumerate(case.seqs):
        got = out[row : row + s.num_new]
        q = case.q[row : row + s.num_new]
        want = reference(q, case.full_k[i], case.full_v[i], case.window, case.softcap)
        if case.q.dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
        row += s.num_new


def available(name: str) -> None:
    if not BACKENDS[name][2]:
        pytest.skip(f"{name}: kernel unavailable here ({cpu_kernels.unavailable_reason()})")


heads = st.sampled_from([(2, 1), (4, 2), (4, 4), (4, 1)])  # (4, 1): Gemma 3 270M
dtypes = st.sampled_from([torch.bfloat16, torch.float32])


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int]:
    """Prefill chunks (some after cached pages) then decodes, and a window from 1 to past
    the longest context."""
    prefills = draw(
        st.lists(st.tuples(st.integers(0, 400), st.integers(2, 150)), min_size=0, max_size=3)
    )
    decodes = draw(st.lists(st.tuples(st.integers(0, 700), st.just(1)), min_size=0, max_size=4))
    if not prefills and not decodes:
        decodes = [(draw(st.integers(0, 700)), 1)]
    longest = max(s + n for s, n in prefills + decodes)
    window = draw(
        st.one_of(st.integers(1, 40), st.integers(1, longest + 20), st.sampled_from([128, 129]))
    )
    return prefills + decodes, window


@pytest.mark.parametrize("name", list(BACKENDS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    step=steps(), hh=heads, dtype=dtypes, d=st.sampled_from([32, 64, 256]), seed=st.integers(0, 9)
)
def test_window_matches_the_dense_masked_reference(
    name: str,
    step: tuple[list[tuple[int, int]], int],
    hh: tuple[int, int],
    dtype: torch.dtype,
    d: int,
    seed: int,
) -> None:
    available(name)
    case = draw_case(name, step, hh, dtype, d, seed)
    out = run_step(BACKENDS[name][0](), case, *hh)
    check_against_reference(out, case)
    factory, hq, hk = BACKENDS[name][0], *hh
    if case.null_pages:  # the null page's contents never matter...
        huge = run_step(factory(), case, hq, hk, torch.finfo(dtype).max)
        assert torch.equal(huge, out)
        # ... and it is never read: NaN there would reach any output that read it
        nan = run_step(factory(), case, hq, hk, math.nan)
        assert torch.equal(nan, out)


def draw_case(
    name: str,
    step: tuple[list[tuple[int, int]], int],
    hh: tuple[int, int],
    dtype: torch.dtype,
    d: int,
    seed: int,
    softcap: float = 0.0,
) -> Case:
    dtypes_run = BACKENDS[name][1]
    spec, window = step
    case = make_case(spec, window, *hh, d, dtype if dtype in dtypes_run else dtypes_run[0], seed)
    case.softcap = softcap
    return case


@pytest.mark.parametrize("name", list(BACKENDS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    step=steps(),
    full=st.booleans(),
    softcap=st.sampled_from([0.5, 1.5, 50.0]),
    hh=heads,
    dtype=dtypes,
    d=st.sampled_from([64, 256]),
    seed=st.integers(0, 9),
)
def test_softcap_matches_the_dense_reference(
    name: str,
    step: tuple[list[tuple[int, int]], int],
    full: bool,
    softcap: float,
    hh: tuple[int, int],
    dtype: torch.dtype,
    d: int,
    seed: int,
) -> None:
    """Gemma 2's attention logit softcap, with and without a window: every backend (the
    split kernel lacks it and steps on the torch reference) against the dense reference."""
    available(name)
    spec, window = step
    case = draw_case(name, (spec, 0 if full else window), hh, dtype, d, seed, softcap)
    case.q = case.q * 4.0  # scores well past the smaller caps
    out = run_step(BACKENDS[name][0](), case, *hh)
    check_against_reference(out, case)
    seen = max(min(st + n, window if not full else st + n) for st, n in spec)
    if softcap < 2.0 and seen >= 8:  # and the cap did bite (a row saw 8 keys or more)
        uncapped = dataclasses.replace(case, softcap=0.0)
        with pytest.raises(AssertionError):
            check_against_reference(out, uncapped)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_decode_at_long_context_sees_its_window_only(name: str) -> None:
    """4K context, window 512: every page before the window is the (NaN-filled) null page."""
    available(name)
    factory, dtypes_run, _ = BACKENDS[name]
    hq, hk = 4, 2
    case = make_case([(4096, 1), (4000, 1), (3000, 1)], 512, hq, hk, 64, dtypes_run[0], 3)
    assert case.null_pages >= 3 * (2900 // BS)
    out = run_step(factory(), case, hq, hk, math.nan)
    check_against_reference(out, case)


def test_the_reference_tells_windows_apart() -> None:
    """A guard for the tests: an off-by-one window gives a different answer."""
    case = make_case([(40, 30), (100, 1)], 9, 2, 1, 32, torch.float32, 0)
    out = run_step(TorchBackend(), case, 2, 1)
    check_against_reference(out, case)
    for wrong in (8, 10):
        case.window = wrong
        with pytest.raises(AssertionError):
            check_against_reference(out, case)


@pytest.mark.skipif(not BACKENDS["cpu-rows"][2], reason="no batch-invariant CPU kernel here")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mine=st.tuples(st.integers(0, 500), st.sampled_from([1, 2, 70, 200])),
    others=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 90)), min_size=1, max_size=4),
    window=st.integers(1, 700),
    dtype=dtypes,
    hh=heads,
    d=st.sampled_from([64, 256]),
)
def test_row_kernel_windows_are_batch_invariant(
    mine: tuple[int, int],
    others: list[tuple[int, int]],
    window: int,
    dtype: torch.dtype,
    hh: tuple[int, int],
    d: int,
) -> None:
    """A sequence's rows are bitwise the same alone and among other prefills and decodes."""
    hq, hk = hh
    alone = make_case([mine], window, hq, hk, d, dtype, 5)
    want = run_step(CpuKernelBackend(), alone, hq, hk)
    spec = sorted([mine, *others], key=lambda s: s[1] == 1)  # prefills first
    where = spec.index(mine)
    batch = make_case(spec, window, hq, hk, d, dtype, 5)  # `mine` has the same data
    out = run_step(CpuKernelBackend(), batch, hq, hk, math.nan)
    first = sum(n for _, n in spec[:where])
    assert torch.equal(out[first : first + mine[1]], want)


def test_flashinfer_gets_window_left_one_less_than_the_window() -> None:
    """FlashInfer's ``window_left`` is inclusive (keys k >= p - window_left): w keys is
    ``w - 1``, given to the prefill and decode wrappers' plan and run; no cascade wrapper."""
    hq, hk, window = 4, 2, 37
    case = make_case([(100, 20), (300, 1), (5, 1)], window, hq, hk, 32, torch.float32, 1)
    flashinfer_standin.calls.clear()
    out = run_step(_flashinfer(), case, hq, hk, math.nan)
    check_against_reference(out, case)
    used = [c for c in flashinfer_standin.calls if c[0].endswith((".plan", ".run"))]
    assert {c[0] for c in used} == {
        f"BatchPrefillWithPagedKVCacheWrapper.{m}" for m in ("plan", "run")
    } | {f"BatchDecodeWithPagedKVCacheWrapper.{m}" for m in ("plan", "run")}
    assert all(c[2]["window_left"] == window - 1 for c in used)
