"""The engine's CPU attention kernel (AVX512_BF16): same math as an fp32 reference, and
caching still never changes greedy outputs when the engine runs on it in bf16."""

from __future__ import annotations

import math
import random

import pytest
import torch

from prefixcache.engine.attention import cpu_kernels, row_kernels

REASON = cpu_kernels.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel: {REASON}")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
    g = hq // hk
    qf = q.float().permute(1, 0, 2)
    kf = k.float().repeat_interleave(g, 1).permute(1, 0, 2)
    vf = v.float().repeat_interleave(g, 1).permute(1, 0, 2)
    s = qf @ kf.transpose(1, 2) * scale
    if causal:
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        s = s.masked_fill(j > i + (lk - lq), -math.inf)
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vf).permute(1, 0, 2), (lse / math.log(2)).transpose(0, 1)


def operands(lq: int, lk: int, hq: int, hk: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(n, h, d, generator=gen).to(torch.bfloat16)
        for n, h in ((lq, hq), (lk, hk), (lk, hk))
    )


def assert_each_decode_matches_reference(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    scale: float,
) -> None:
    """Decode i's output and LSE equal the fp32 reference over its first lens[i] paged keys."""
    _, _, bs, hk, d = kv.shape
    for i, n in enumerate(lens):
        pages = tables[i, : -(-n // bs)].long()
        k = kv[pages, 0].reshape(-1, hk, d)[:n]
        v = kv[pages, 1].reshape(-1, hk, d)[:n]
        ref_out, ref_lse = reference(q[i : i + 1], k, v, scale, causal=False)
        torch.testing.assert_close(out[i : i + 1].float(), ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[i : i + 1], ref_lse, atol=1e-4, rtol=1e-5)


def test_unavailable_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_CPU_KERNELS", "0")
    assert cpu_kernels.unavailable_reason() == "PREFIXCACHE_CPU_KERNELS=0"
    monkeypatch.delenv("PREFIXCACHE_CPU_KERNELS")
    avx2_only = "flags\t\t: fpu sse2 avx avx2 fma\n"
    assert "avx512_bf16" in (cpu_kernels.unavailable_reason(avx2_only) or "")


@needs_kernel
@pytest.mark.parametrize(
    ("lq", "lk", "hq", "hk", "d", "causal"),
    [
        (1, 1, 8, 2, 64, True),
        (37, 37, 8, 2, 64, True),  # not a multiple of 16
        (300, 300, 8, 2, 64, True),  # several key blocks, a ragged last one
        (64, 1000, 8, 2, 64, True),  # bottom-right causal: queries at the end of the keys
        (5, 300, 8, 2, 64, False),
        (1, 17, 4, 4, 64, False),  # no GQA
        (150, 150, 4, 4, 96, True),  # Phi-3 mini's head dim: three column chunks of two
        (3, 300, 6, 2, 96, False),
        (100, 100, 4, 4, 128, True),
        (200, 200, 12, 4, 32, True),
        (129, 257, 9, 3, 64, False),  # g = 3: tiles of 4 rows mix tokens
    ],
)
def test_kernel_matches_fp32_reference(
    lq: int, lk: int, hq: int, hk: int, d: int, causal: bool
) -> None:
    q, k, v = operands(lq, lk, hq, hk, d, seed=lq * 7 + lk)
    scale = 1.0 / math.sqrt(d)
    out, lse = cpu_kernels.attention(q, k, v, scale, causal)
    ref_out, ref_lse = reference(q, k, v, scale, causal)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # bf16 output and bf16 P for the PV product: about two bf16 ulps of an O(1) value.
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_kernel_reads_strided_views_of_a_fused_projection() -> None:
    """q/k/v are column slices of one QKV matrix in the engine: token stride != heads * d."""
    lq, hq, hk, d = 150, 8, 2, 64
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(lq, (hq + 2 * hk) * d, generator=gen).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(lq, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(lq, hk, d)
    v = qkv[:, (hq + hk) * d :].view(lq, hk, d)
    out, lse = cpu_kernels.attention(q, k, v, 0.125, True)
    ref_out, ref_lse = cpu_kernels.attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.125, True
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@needs_kernel
@pytest.mark.parametrize(
    ("invariant", "kernels"),
    [(True, ("attend_call",)), (False, ("attention", "paged_decode"))],
)
def test_bf16_engine_caching_never_changes_greedy_outputs(
    monkeypatch: pytest.MonkeyPatch, invariant: bool, kernels: tuple[str, ...]
) -> None:
    """The engine in bf16 on the kernel: cold, warm (prefix cached), chunked and batched
    greedy runs give the same tokens (batch-invariant by default: one kernel call per layer,
    built by ``attend_call`` whether it runs at once or in a replayed step; off: the split
    prefill and decode kernels)."""
    calls = dict.fromkeys(kernels, 0)
    module = row_kernels if invariant else cpu_kernels
    for name in calls:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(module, name, counted)
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.engine import LLMEngine
    from prefixcache.engine.model.loader import load_model
    from prefixcache.engine.request import SamplingParams

    loaded = load_model("demo", dtype="bfloat16", device="cpu")
    rng = random.Random(5)
    vocab = loaded.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(150)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (9, 33, 17)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)

    def engine(**overrides) -> LLMEngine:
        config = EngineConfig(
            model="demo", dtype="bfloat16", device="cpu", num_blocks=256, batch_invariant=invariant
        )
        for key, value in overrides.items():
            setattr(config, key, value)
        return LLMEngine(config, loaded)

    cold = [engine(enable_prefix_caching=False).generate([p], greedy)[0].token_ids for p in prompts]
    warm_engine = engine()
    warm_engine.generate([prefix], SamplingParams(max_tokens=1))
    warm = [warm_engine.generate([p], greedy)[0] for p in prompts]
    assert all(out.usage.cached_tokens >= 144 for out in warm), "the prefix must be cached"
    chunked = engine(max_num_batched_tokens=40).generate(prompts, greedy)
    batched = engine().generate(prompts, greedy)
    assert [out.token_ids for out in warm] == cold
    assert [out.token_ids for out in chunked] == cold
    assert [out.token_ids for out in batched] == cold
    assert all(n > 0 for n in calls.values()), calls


@needs_kernel
@pytest.mark.parametrize(
    ("hq", "hk", "d"), [(8, 2, 64), (9, 3, 64), (4, 4, 128), (12, 2, 32), (6, 2, 96)]
)
def test_paged_decode_reads_pages_in_place(hq: int, hk: int, d: int) -> None:
    """Ragged lengths (1 token, mid-block, whole blocks), shuffled page ids, padded tables."""
    gen = torch.Generator().manual_seed(hq * d)
    num_blocks, bs = 64, 16
    kv = torch.randn(num_blocks, 2, bs, hk, d, generator=gen).to(torch.bfloat16)
    lens = [1, 16, 17, 100, 255, 3]
    width = max(-(-n // bs) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        pages = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)]
        tables[i, : len(pages)] = pages.to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(d)
    out, lse = cpu_kernels.paged_decode(q, kv, tables, torch.tensor(lens), scale)
    assert_each_decode_matches_reference(out, lse, q, kv, tables, lens, scale)


@needs_kernel
@pytest.mark.parametrize(
    ("hq", "hk", "d"), [(8, 2, 64), (9, 3, 64), (4, 4, 128), (12, 2, 32), (6, 2, 96)]
)
def test_paged_decode_reads_a_cascade_groups_shared_pages_once(hq: int, hk: int, d: int) -> None:
    """Sequences 1-11 share 5 blocks (more members than one task takes: the group is split),
    13-14 share 2; 0, 12 and 15 stand alone. Each output is attention over all its keys."""
    gen = torch.Generator().manual_seed(hq + d)
    num_blocks, bs = 160, 16
    kv = torch.randn(num_blocks, 2, bs, hk, d, generator=gen).to(torch.bfloat16)
    pages = torch.randperm(num_blocks, generator=gen).tolist()
    shared = {1: pages[:5], 13: pages[5:7]}
    groups = [(1, 12, 5 * bs), (13, 15, 2 * bs)]
    own_lens = [40, 1, 7, 16, 17, 30, 2, 3, 50, 9, 1, 33, 70, 5, 16, 20]
    free = iter(pages[7:])
    tables, lens = [], []
    for s, own in enumerate(own_lens):
        head = next((shared[b] for b, e, _ in groups if b <= s < e), [])
        tables.append(head + [next(free) for _ in range(-(-own // bs))])
        lens.append(len(head) * bs + own)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(d)
    lens_t = torch.tensor(lens)
    out, lse = cpu_kernels.paged_decode(q, kv, table, lens_t, scale, torch.tensor(groups))
    plain_out, plain_lse = cpu_kernels.paged_decode(q, kv, table, lens_t, scale)
    assert_each_decode_matches_reference(out, lse, q, kv, table, lens, scale)
    alone = [0, 12, 15]  # no group: the same code path as without groups, bit for bit
    assert torch.equal(out[alone], plain_out[alone]) and torch.equal(lse[alone], plain_lse[alone])


@needs_kernel
def test_bf16_cascade_decode_on_the_kernel_matches_plain_decode() -> None:
    """Decodes over a shared cached prefix: the cascade (prefix once per group, then each
    member's own pages, merged in the kernel) gives the logits of each decode reading all
    its pages."""
    from prefixcache.engine.attention import create_backend
    from prefixcache.engine.memory.kv_cache import KVCache
    from prefixcache.engine.model.loader import load_model
    from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

    loaded = load_model("demo", dtype="bfloat16", device="cpu")
    bs, vocab = 16, loaded.config.vocab_size
    plans: list = []
    runner = ModelRunner(
        loaded,
        KVCache(loaded.kv_cache_spec(bs), num_blocks=64),
        create_backend("cpu-split", "cpu"),
        on_plan=plans.append,
    )
    rng = random.Random(9)
    shared = [rng.randrange(3, vocab) for _ in range(96)]  # 6 full blocks
    runner.execute([BatchEntry(shared, 0, list(range(6)), compute_logits=False)])
    tails = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 20, 9, 1)]
    tables = [[*range(6), 10 + 2 * i, 11 + 2 * i] for i in range(len(tails))]
    runner.execute([BatchEntry(t, 96, tb) for t, tb in zip(tails, tables, strict=True)])
    batch = [
        BatchEntry([5 + i], 96 + len(t), tb)
        for i, (t, tb) in enumerate(zip(tails, tables, strict=True))
    ]
    cascade = runner.execute(batch)
    assert plans[-1].cascade_groups
    runner.enable_cascade = False
    plain = runner.execute(batch)
    assert not plans[-1].cascade_groups
    torch.testing.assert_close(cascade, plain, atol=0.1, rtol=0.05)
    assert cascade.argmax(-1).tolist() == plain.argmax(-1).tolist()


@needs_kernel
@pytest.mark.parametrize(
    ("lq", "num_keys", "causal"), [(7, 300, False), (40, 40, True), (5, 17, False)]
)
def test_paged_attention_reads_the_pages_of_a_block_table(
    lq: int, num_keys: int, causal: bool
) -> None:
    gen = torch.Generator().manual_seed(lq + num_keys)
    num_blocks, bs, hq, hk, d = 64, 16, 8, 2, 64
    kv = torch.randn(num_blocks, 2, bs, hk, d, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(num_blocks, generator=gen)[: -(-num_keys // bs)].to(torch.int32)
    q = torch.randn(lq, hq, d, generator=gen).to(torch.bfloat16)
    out, lse = cpu_kernels.paged_attention(q, kv, ids, num_keys, 0.125, causal)
    k = kv[ids.long(), 0].reshape(-1, hk, d)[:num_keys]
    v = kv[ids.long(), 1].reshape(-1, hk, d)[:num_keys]
    dense_out, dense_lse = cpu_kernels.attention(q, k, v, 0.125, causal)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)


@needs_kernel
def test_merge_states_kernel_matches_torchs_merge() -> None:
    """The one-pass merge against torch's ops: the same bf16 outputs (exp2/log2 may differ in
    the last fp32 bit, so a rare output may round the other way), empty states included."""
    from prefixcache.engine.attention import torch_ops

    gen = torch.Generator().manual_seed(3)
    n, h, d = 37, 8, 64
    o_a, o_b = (torch.randn(n, h, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(n, h, generator=gen) * 4 for _ in range(2))
    lse_a[0], lse_b[1] = -math.inf, -math.inf  # one side empty
    lse_a[2], lse_b[2] = -math.inf, -math.inf  # both empty: 0 and -inf
    out, lse = cpu_kernels.merge_states(o_a, lse_a, o_b, lse_b)
    ref, ref_lse = torch_ops.merge_states(o_a, lse_a, o_b, lse_b)
    assert (out == ref).float().mean() > 0.999
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[2], torch.zeros(h, d, dtype=torch.bfloat16))
    assert torch.isinf(lse[2]).all() and (lse[2] < 0).all()
    assert torch.equal(out[0], o_b[0]) and torch.equal(out[1], o_a[1])
