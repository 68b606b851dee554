"""A step's attention plan built from the sequences' lists (the few-token path: decodes,
short suffixes) equals the one built by tensor ops from the metadata, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.attention import backend
from prefixcache.engine.attention.backend import AttentionShape, write_rows
from prefixcache.engine.attention.cpu_backend import CpuKernelBackend
from prefixcache.engine.attention.metadata import AttentionMetadata, SeqSpec, plan_step_order

BS = 4


@st.composite
def steps(draw: st.DrawFn) -> list[SeqSpec]:
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        new = draw(st.integers(1, 12))
        pages = -(-(start + new) // BS) + draw(st.integers(0, 2))  # tables may run longer
        table = draw(st.lists(st.integers(0, 63), min_size=pages, max_size=pages, unique=True))
        seqs.append(SeqSpec(start, new, table))
    return seqs


def _tensor_write_rows(meta: AttentionMetadata) -> torch.Tensor:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "FEW_WRITE_ROWS", -1)
        return write_rows(meta)


@settings(max_examples=150, deadline=None)
@given(seqs=steps(), cascade=st.booleans())
def test_plan_from_lists_equals_tensor_ops(seqs: list[SeqSpec], cascade: bool) -> None:
    order, groups = plan_step_order(seqs, BS, cascade, min_shared_blocks=1)
    meta = AttentionMetadata.build([seqs[i] for i in order], BS, cascade_groups=groups)
    rows = write_rows(meta)
    expected = _tensor_write_rows(meta)
    assert rows.dtype == expected.dtype and torch.equal(rows, expected)
    shape = AttentionShape(4, 2, 64, torch.bfloat16)
    plan_backend = CpuKernelBackend()
    plan_backend.prepare(shape, torch.device("cpu"))
    if plan_backend._reference is not None:
        pytest.skip("no CPU row kernel here")
    plan_backend.plan(meta, shape)
    plan = plan_backend._rows
    pages = (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).tolist()
    tables = torch.zeros(meta.num_seqs, max(pages), dtype=torch.int32)
    for i, n in enumerate(pages):
        tables[i, :n] = meta.kv_indices[meta.kv_indptr[i] : meta.kv_indptr[i] + n]
    assert plan.tables.dtype == torch.int32 and plan.tables.is_contiguous()
    assert torch.equal(plan.tables, tables)
    assert torch.equal(plan.kv_lens, torch.tensor([s.kv_len for s in meta.seqs]))
    assert torch.equal(plan.qo_indptr, meta.qo_indptr.long())
    want = [[g.begin, g.end, g.num_shared_blocks * BS] for g in meta.cascade_groups]
    assert plan.groups.tolist() == want and plan.groups.shape[-1] == 3
    assert torch.equal(plan_backend._write_rows, expected)
