"""FlashInferBackend's plan and forward code on CPU, over the stand-in for FlashInfer's documented
semantics (tests/flashinfer_standin.py: not FlashInfer's kernels).

Outputs equal the torch backend's for prefills, cached prefills, decodes and cascade groups;
the sliding window matches a dense reference; the host page tables equal the metadata's and
are built without reading a tensor back; with batch invariance on, a sequence's output is
bitwise the same whatever shares its step (and with it off, under the stand-in's batch-sized
split heuristic, it is not); the CPU-side plan of a 32-sequence step takes at most 0.5 ms.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import flashinfer_standin
import pytest
import torch

from prefixcache.engine.attention import (
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    plan_step_order,
)
from prefixcache.engine.attention.flashinfer_backend import FIXED_SPLIT_PAGES, FlashInferBackend
from prefixcache.engine.attention.flashinfer_plan import PlanBuffers, build_tables
from prefixcache.engine.attention.torch_backend import TorchBackend

BS = 16


def standin_backend(**kwargs: Any) -> FlashInferBackend:
    return FlashInferBackend("cpu", module=flashinfer_standin, workspace_bytes=16, **kwargs)


@dataclass
class Case:
    seqs: list[SeqSpec]
    kv_layer: torch.Tensor
    q: torch.Tensor  # rows in the caller's sequence order
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]


def make_case(
    spec: list[tuple[int, int]],
    hq: int,
    hk: int,
    d: int = 32,
    shared: int = 0,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Case:
    """``spec``: (start_pos, num_new) per sequence; the first ``shared`` tokens (whole blocks)
    are the same blocks for every sequence that starts after them; pages are shuffled. A sequence's data depends only
    on its (start_pos, num_new) and ``seed``, not on its place or companions."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_blocks = sum(-(-(s + n) // BS) for s, n in spec) + 8
    free = list(range(num_blocks))
    rnd.shuffle(free)
    shared_blocks = [free.pop() for _ in range(shared // BS)]
    shared_kv = torch.randn(shared, 2, hk, d, generator=gen)
    kv_layer = torch.zeros(num_blocks, 2, BS, hk, d)
    seqs, fk, fv, qs, ks, vs = [], [], [], [], [], []
    for start, n in spec:
        total = start + n
        mine = shared_blocks if start >= shared else []  # shorter ones share nothing
        table = mine + [free.pop() for _ in range(-(-total // BS) - len(mine))]
        own_gen = torch.Generator().manual_seed(seed * 100_003 + start * 1_009 + n)
        kv = torch.randn(total, 2, hk, d, generator=own_gen)
        if mine:
            kv[:shared] = shared_kv
        for pos in range(start):
            kv_layer[table[pos // BS], :, pos % BS] = kv[pos]
        seqs.append(SeqSpec(start, n, table))
        fk.append(kv[:, 0])
        fv.append(kv[:, 1])
        qs.append(torch.randn(n, hq, d, generator=own_gen))
        ks.append(kv[start:, 0])
        vs.append(kv[start:, 1])

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    q, k, v = (put(torch.cat(x)) for x in (qs, ks, vs))
    return Case(seqs, put(kv_layer), q, k, v, fk, fv)


def run(
    backend: Any, case: Case, hq: int, hk: int, cascade: bool
) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """Per-sequence outputs (caller order) of one step through ``backend``."""
    dev = case.kv_layer.device
    order, groups = plan_step_order(case.seqs, BS, cascade)
    meta = AttentionMetadata.build([case.seqs[i] for i in order], BS, dev, groups)
    starts = [0]
    for s in case.seqs:
        starts.append(starts[-1] + s.num_new)
    rows = torch.tensor([r for i in order for r in range(starts[i], starts[i + 1])], device=dev)
    d = case.q.shape[2]
    backend.plan(meta, AttentionShape(hq, hk, d, case.q.dtype))
    layer = case.kv_layer.clone()
    out = backend.forward(case.q[rows], case.k[rows], case.v[rows], layer)
    result = torch.empty_like(out)
    result[rows] = out
    return [result[starts[i] : starts[i + 1]] for i in range(len(case.seqs))], meta


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = -1) -> torch.Tensor:
    """Dense bottom-right causal attention of one sequence in float64, optional window."""
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    kf = k.double().repeat_interleave(hq // hk, dim=1)
    vf = v.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kf) / math.sqrt(d)
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    drop = j > i
    if window >= 0:
        drop |= j < i - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(drop, -math.inf).softmax(-1), vf)


MIXED = [(0, 37), (16, 16), (45, 100), (130, 7), (0, 1), (63, 1), (200, 1), (15, 2), (31, 1)]
GROUPED = [(64 + 7 * i + (i % 3), 1) for i in range(6)] + [(70, 9), (64, 20), (90, 1)]


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize(("hq", "hk"), [(4, 4), (8, 2)])
def test_backend_equals_torch_backend(invariant: bool, hq: int, hk: int) -> None:
    for spec, shared, cascade in ((MIXED, 0, False), (GROUPED, 64, True), (GROUPED, 64, False)):
        case = make_case(spec, hq, hk, shared=shared, seed=hq + hk)
        flashinfer_standin.calls.clear()
        got, meta = run(standin_backend(batch_invariant=invariant), case, hq, hk, cascade)
        want, _ = run(TorchBackend(), case, hq, hk, cascade)
        row = 0
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
            ref = reference(case.q[row : row + len(a)], case.full_k[i], case.full_v[i])
            torch.testing.assert_close(a.double(), ref, atol=2e-5, rtol=1e-4)
            row += len(a)
        names = {c[0] for c in flashinfer_standin.calls}
        used_cascade = "MultiLevelCascadeAttentionWrapper.run" in names
        assert used_cascade == (bool(meta.cascade_groups) and not invariant)


def test_sliding_window_follows_the_documented_mask() -> None:
    """``window_left = W``: a row at position p sees keys [p - W, p]; cascade groups then go
    through the decode wrapper (a window is not the same mask on one level's pages)."""
    hq, hk, window = 4, 2, 21
    for spec, shared in ((MIXED, 0), (GROUPED, 64)):
        case = make_case(spec, hq, hk, shared=shared, seed=7)
        flashinfer_standin.calls.clear()
        backend = standin_backend(batch_invariant=False, window_left=window)
        got, meta = run(backend, case, hq, hk, cascade=True)
        row = 0
        for i, out in enumerate(got):
            n = case.seqs[i].num_new
            want = reference(case.q[row : row + n], case.full_k[i], case.full_v[i], window)
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
            row += n
        names = [c[0] for c in flashinfer_standin.calls]
        assert "MultiLevelCascadeAttentionWrapper.run" not in names
        plans = [c for c in flashinfer_standin.calls if c[0].endswith(".plan")]
        assert plans and all(c[2]["window_left"] == window for c in plans)
        assert not shared or meta.cascade_groups


def test_host_tables_match_the_metadata_without_reading_tensors_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = make_case(GROUPED + MIXED, 4, 2, shared=64, seed=3)
    order, groups = plan_step_order(case.seqs, BS, True)
    meta = AttentionMetadata.build([case.seqs[i] for i in order], BS, "cpu", groups)
    assert meta.cascade_groups and meta.num_prefills
    bufs = PlanBuffers(torch.device("cpu"), max_num_seqs=4, max_num_pages=8)  # grows

    def no_readback(*_: Any, **__: Any) -> Any:
        raise AssertionError("the plan read a tensor back to the host")

    with monkeypatch.context() as m:
        for name in ("tolist", "item", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, no_readback)
        tables = build_tables(meta, bufs, use_cascade=True)
    p, c, n = meta.num_prefills, meta.cascade_begin, meta.num_seqs
    kv = meta.kv_indptr.tolist()
    assert tables.prefill is not None and tables.decode is not None and tables.cascade
    assert tables.prefill.qo_indptr.tolist() == meta.qo_indptr[: p + 1].tolist()
    assert tables.prefill.kv_indptr.tolist() == kv[: p + 1]
    assert tables.prefill.last_page_len.tolist() == meta.kv_last_page_len[:p].tolist()
    assert tables.decode.kv_indptr.tolist() == [x - kv[p] for x in kv[p : c + 1]]
    assert tables.decode.kv_indices.tolist() == meta.kv_indices[kv[p] : kv[c]].tolist()
    top, low = tables.cascade
    expect_top, expect_low, low_last = [], [], []
    for g in meta.cascade_groups:
        expect_top += list(meta.seqs[g.begin].block_table[: g.num_shared_blocks])
        for s in meta.seqs[g.begin : g.end]:
            pages = -(-s.kv_len // BS)
            expect_low += list(s.block_table[g.num_shared_blocks : pages])
            low_last.append(s.kv_len - (pages - 1) * BS)
    assert top.kv_indices.tolist() == expect_top
    assert top.last_page_len.tolist() == [BS] * len(meta.cascade_groups)
    assert low.kv_indices.tolist() == expect_low
    assert low.last_page_len.tolist() == low_last
    assert low.qo_indptr.tolist() == list(range(n - c + 1))
    assert tables.rows == (int(meta.qo_indptr[p]), int(meta.qo_indptr[c]), meta.num_tokens)


def test_batch_invariant_plan_does_not_depend_on_the_batch() -> None:
    """One sequence's output, alone and among others (of both kinds, either side of it), is
    bitwise equal with the fixed split; the stand-in's batch-sized heuristic breaks that."""
    hq, hk = 8, 2
    mine = (700, 1)  # 44 pages: several splits under any split size
    others = [(300, 1), (0, 40), (1200, 1), (90, 1), (500, 1)]
    for invariant in (True, False):
        results = []
        for spec in ([mine], [*others[:2], mine], [mine, *others]):
            flashinfer_standin.calls.clear()
            case = make_case(spec, hq, hk, seed=11)  # `mine` has the same data every time
            where = spec.index(mine)
            got, _ = run(standin_backend(batch_invariant=invariant), case, hq, hk, True)
            results.append(got[where])
            plans = [c[2] for c in flashinfer_standin.calls if c[0].endswith(".plan")]
            splits = {(c["fixed_split_size"], c["disable_split_kv"]) for c in plans}
            want = (FIXED_SPLIT_PAGES, False) if invariant else (None, False)
            assert splits == {want}
        same = all(torch.equal(results[0], r) for r in results[1:])
        assert same == invariant, f"batch_invariant={invariant}"


class _NullWrapper:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def plan(self, *args: Any, **kwargs: Any) -> None:
        pass


class _NullFlashInfer:
    """Wrappers whose plan does nothing: what is left is the backend's own plan work."""

    BatchPrefillWithPagedKVCacheWrapper = _NullWrapper
    BatchDecodeWithPagedKVCacheWrapper = _NullWrapper
    MultiLevelCascadeAttentionWrapper = _NullWrapper


@pytest.mark.parametrize("cascade", [False, True])
def test_plan_of_32_sequences_takes_at_most_half_a_millisecond(cascade: bool) -> None:
    """32 decodes over an 8K shared prefix (as one cascade group, or as plain decodes)."""
    shared = list(range(512))
    seqs = [
        SeqSpec(8192 + 20 + i, 1, [*shared, *range(600 + 4 * i, 604 + 4 * i)]) for i in range(32)
    ]
    order, groups = plan_step_order(seqs, BS, cascade)
    meta = AttentionMetadata.build([seqs[i] for i in order], BS, "cpu", groups)
    backend = FlashInferBackend(
        "cpu", module=_NullFlashInfer, batch_invariant=not cascade, workspace_bytes=16
    )  # type: ignore[arg-type]
    shape = AttentionShape(8, 2, 64, torch.bfloat16)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        backend.plan(meta, shape)
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(f"plan of 32 sequences ({'cascade' if cascade else 'plain'}): best {best * 1e3:.3f} ms,"
          f" median {sorted(times)[100] * 1e3:.3f} ms")  # fmt: skip
    assert best <= 0.5e-3
