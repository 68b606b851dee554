"""Torch paged attention equals a dense reference for ragged batches; the LSE is base 2."""

from __future__ import annotations

import math
import random

import pytest
import torch

from prefixcache.engine.attention import (
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    create_backend,
    plan_step_order,
)
from prefixcache.engine.attention.torch_backend import TorchBackend
from prefixcache.engine.attention.torch_ops import (
    dense_attention,
    merge_states,
    padded_decode_attention,
)

BS = 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense bottom-right causal attention for one sequence, float64. q [Lq,Hq,D], k [Lk,Hk,D]."""
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    s = s.masked_fill(j > i + (lk - lq), -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def run_paged(
    seqs_spec: list[tuple[int, int]],
    hq: int,
    hk: int,
    d: int = 32,
    shared_prefix: int = 0,
    enable_cascade: bool = False,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], AttentionMetadata]:
    """seqs_spec: (start_pos, num_new). Returns per-sequence outputs and references."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_blocks = sum(-(-(s + n) // BS) for s, n in seqs_spec) + 64
    free = list(range(num_blocks))
    rnd.shuffle(free)
    shared_blocks = [free.pop() for _ in range(shared_prefix // BS)]
    kv_layer = torch.zeros(num_blocks, 2, BS, hk, d)
    shared_kv = torch.randn(shared_prefix, 2, hk, d, generator=gen)
    specs, full_k, full_v = [], [], []
    for start, n in seqs_spec:
        total = start + n
        own = [free.pop() for _ in range(-(-total // BS) - len(shared_blocks))]
        table = shared_blocks + own
        kv = torch.randn(total, 2, hk, d, generator=gen)
        if shared_prefix:
            kv[:shared_prefix] = shared_kv
        for pos in range(start):  # the cached part is already in its pages
            kv_layer[table[pos // BS], :, pos % BS] = kv[pos]
        specs.append(SeqSpec(start, n, table))
        full_k.append(kv[:, 0])
        full_v.append(kv[:, 1])
    order, groups = plan_step_order(specs, BS, enable_cascade)
    ordered = [specs[i] for i in order]
    meta = AttentionMetadata.build(ordered, BS, "cpu", groups)
    qs = [torch.randn(n, hq, d, generator=gen) for _, n in seqs_spec]
    q = torch.cat([qs[i] for i in order])
    k = torch.cat([full_k[i][specs[i].start_pos :] for i in order])
    v = torch.cat([full_v[i][specs[i].start_pos :] for i in order])
    backend = TorchBackend()
    backend.plan(meta, AttentionShape(hq, hk, d, torch.float32))
    out = backend.forward(q, k, v, kv_layer)
    scale = 1 / math.sqrt(d)
    outs: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    refs: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    qo = meta.qo_indptr.tolist()
    for j, i in enumerate(order):
        outs[i] = out[qo[j] : qo[j + 1]]
        refs[i] = reference(qs[i], full_k[i], full_v[i], scale).float()
    # New K/V landed in their pages.
    for i, s in enumerate(specs):
        for pos in (s.start_pos, s.kv_len - 1):
            blk = s.block_table[pos // BS]
            torch.testing.assert_close(kv_layer[blk, 0, pos % BS], full_k[i][pos])
    return outs, refs, meta


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (8, 2)])
def test_paged_attention_equals_dense_for_ragged_batches(hq: int, hk: int) -> None:
    rnd = random.Random(hq * 10 + hk)
    for trial in range(3):
        spec = []
        for _ in range(6):
            kind = rnd.choice(["prefill", "cached_prefill", "decode"])
            if kind == "prefill":
                spec.append((0, rnd.randint(2, 70)))
            elif kind == "cached_prefill":
                spec.append((rnd.randint(1, 90), rnd.randint(2, 40)))
            else:
                spec.append((rnd.randint(0, 100), 1))
        outs, refs, meta = run_paged(spec, hq, hk, seed=trial)
        assert meta.num_prefills + meta.num_plain_decodes == len(spec)
        for o, r in zip(outs, refs, strict=True):
            torch.testing.assert_close(o, r, atol=2e-5, rtol=1e-4)


def test_partial_last_pages_and_exact_page_boundaries() -> None:
    spec = [(0, 16), (16, 16), (15, 1), (16, 1), (31, 2), (47, 1), (0, 1)]
    outs, refs, meta = run_paged(spec, 4, 2)
    by_len = {
        s.kv_len: last for s, last in zip(meta.seqs, meta.kv_last_page_len.tolist(), strict=True)
    }
    assert by_len[16] == 16 and by_len[32] == 16 and by_len[33] == 1 and by_len[48] == 16
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o, r, atol=2e-5, rtol=1e-4)


def test_large_decode_batches_are_gathered_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixcache.engine.attention import torch_backend

    assert torch_backend._decode_chunks([100, 20, 300, 5], 16) == [(0, 4)]
    monkeypatch.setattr(torch_backend, "_GATHER_TOKENS", 320)
    assert torch_backend._decode_chunks([100, 20, 300, 5], 16) == [(0, 2), (2, 3), (3, 4)]
    spec = [(100, 1), (20, 1), (299, 1), (4, 1), (64, 1)]
    outs, refs, _ = run_paged(spec, 8, 2, seed=9)
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o, r, atol=2e-5, rtol=1e-4)


def test_metadata_is_flashinfer_form() -> None:
    seqs = [SeqSpec(0, 20, [7, 3]), SeqSpec(16, 1, [5, 9, 11])]
    meta = AttentionMetadata.build(seqs, BS)
    assert meta.qo_indptr.tolist() == [0, 20, 21]
    assert meta.kv_indptr.tolist() == [0, 2, 4]
    assert meta.kv_indices.tolist() == [7, 3, 5, 9]
    assert meta.kv_last_page_len.tolist() == [4, 1]
    assert meta.positions.tolist() == [*range(20), 16]
    assert meta.qo_indptr.dtype == torch.int32 and meta.kv_indices.dtype == torch.int32


def test_lse_is_base_two() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=gen)
    k = torch.randn(9, 2, 16, generator=gen)
    v = torch.randn(9, 2, 16, generator=gen)
    scale = 0.25
    s = torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(2, dim=1)) * scale
    expected = torch.logsumexp(s, -1) / math.log(2)
    _, lse = dense_attention(q, k, v, scale, causal=False)
    torch.testing.assert_close(lse, expected, atol=1e-5, rtol=1e-5)
    # The padded decode path too: each query over the same 9 keys plus 7 padding rows.
    pad_k = torch.cat([k, torch.randn(7, 2, 16, generator=gen)])[None].expand(5, 16, 2, 16)
    pad_v = torch.cat([v, torch.randn(7, 2, 16, generator=gen)])[None].expand(5, 16, 2, 16)
    o, lse2 = padded_decode_attention(q, pad_k, pad_v, torch.full((5,), 9), scale)
    torch.testing.assert_close(lse2, expected, atol=1e-5, rtol=1e-5)
    o_ref, _ = dense_attention(q, k, v, scale, causal=False)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)


def test_merge_states_matches_joint_attention_and_handles_empty() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 8, generator=gen)
    k = torch.randn(12, 2, 8, generator=gen)
    v = torch.randn(12, 2, 8, generator=gen)
    oa, la = dense_attention(q, k[:5], v[:5], 0.3, causal=False)
    ob, lb = dense_attention(q, k[5:], v[5:], 0.3, causal=False)
    o, lse = merge_states(oa, la, ob, lb)
    o_all, l_all = dense_attention(q, k, v, 0.3, causal=False)
    torch.testing.assert_close(o, o_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, l_all, atol=1e-5, rtol=1e-5)
    empty = torch.full((3, 2), -math.inf)
    o0, l0 = merge_states(torch.zeros(3, 2, 8), empty, torch.zeros(3, 2, 8), empty)
    assert torch.all(o0 == 0) and torch.all(torch.isneginf(l0))


def test_generic_path_matches_cpu_kernel_path() -> None:
    from prefixcache.engine.attention.torch_ops import _dense_attention_generic

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(40, 8, 16, generator=gen)
    k = torch.randn(40, 2, 16, generator=gen)
    v = torch.randn(40, 2, 16, generator=gen)
    for causal in (False, True):
        o1, l1 = dense_attention(q, k, v, 0.25, causal)
        o2, l2 = _dense_attention_generic(q, k, v, 0.25, causal)
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


def test_generic_padded_decode_matches_cpu_kernel_path() -> None:
    from prefixcache.engine.attention.torch_ops import _padded_decode_generic

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 8, 16, generator=gen)
    k = torch.randn(3, 20, 2, 16, generator=gen)
    v = torch.randn(3, 20, 2, 16, generator=gen)
    lens = torch.tensor([20, 5, 1])
    o1, l1 = padded_decode_attention(q, k, v, lens, 0.25)
    pad = torch.arange(20)[None, :] >= lens[:, None]
    qh, kh, vh = q.view(3, 2, 4, 16), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    o2, l2 = _padded_decode_generic(qh, kh, vh, pad, 0.25)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


def test_create_backend() -> None:
    assert create_backend("torch", "cpu").name == "torch"
    assert create_backend("auto", "cpu").name == "cpu"  # the batch-invariant kernel backend
    assert create_backend("auto", "cpu", batch_invariant=False).name == "cpu-split"
    assert create_backend("torch", "cpu").name == "torch"  # the reference, by name
    with pytest.raises(ValueError, match="CUDA"):
        create_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("magic", "cpu")
