"""On CUDA with flashinfer installed: FlashInferBackend (FlashInfer's real kernels) against the
torch backend and a dense reference, in bf16. Skipped elsewhere (every CPU run, CI); run by
bench/gpu_check.py on a lent GPU (docs/models.md, "GPU check").

Prefill (fresh, after cached pages, partial pages) next to decodes; decodes over a shared
prefix with the cascade wrapper and without; a sliding window; Gemma 2's logits_soft_cap; a
sequence's output bitwise the same alone and in a batch with the fixed split; the demo model
end to end, on bf16 and on fp8 pages.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_flashinfer_standin import GROUPED, MIXED, make_case, reference, run

from prefixcache.engine.attention.flashinfer_backend import FlashInferBackend
from prefixcache.engine.attention.torch_backend import TorchBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"
    ),
]
BF16_ATOL = 2e-2


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize(("hq", "hk", "d"), [(8, 4, 64), (32, 8, 128)])
def test_flashinfer_equals_torch_backend(invariant: bool, hq: int, hk: int, d: int) -> None:
    for spec, shared in ((MIXED, 0), (GROUPED, 64), (GROUPED + MIXED, 64)):
        case = make_case(spec, hq, hk, d, shared, seed=d, device="cuda", dtype=torch.bfloat16)
        got, meta = run(FlashInferBackend("cuda", batch_invariant=invariant), case, hq, hk, True)
        want, _ = run(TorchBackend(), case, hq, hk, True)
        row = 0
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(a.float(), b.float(), atol=BF16_ATOL, rtol=2e-2)
            n = case.seqs[i].num_new
            ref = reference(case.q[row : row + n].cpu(), case.full_k[i], case.full_v[i])
            torch.testing.assert_close(a.cpu().double(), ref, atol=BF16_ATOL, rtol=2e-2)
            row += n
        assert not shared or meta.cascade_groups


@pytest.mark.parametrize("window", [0, 21, 100])
def test_flashinfer_sliding_window(window: int) -> None:
    hq, hk, d = 8, 4, 64  # the demo model's shape: kernels the other tests compile too
    for spec, shared in ((MIXED, 0), (GROUPED, 64)):
        case = make_case(spec, hq, hk, d, shared, seed=3, device="cuda", dtype=torch.bfloat16)
        backend = FlashInferBackend("cuda", batch_invariant=False, window_left=window)
        got, _ = run(backend, case, hq, hk, True)
        row = 0
        for i, out in enumerate(got):
            n = case.seqs[i].num_new
            ref = reference(case.q[row : row + n].cpu(), case.full_k[i], case.full_v[i], window)
            torch.testing.assert_close(out.cpu().double(), ref, atol=BF16_ATOL, rtol=2e-2)
            row += n


@pytest.mark.parametrize("window", [1, 64, 513])
def test_flashinfer_metadata_window_over_null_pages(window: int) -> None:
    """A windowed metadata (window_left = window - 1), the pages before every window mapped
    to a null page full of the largest finite bf16: the dense masked reference still."""
    import test_sliding_window as sw

    hq, hk, d = 8, 4, 64
    spec = [(900, 200), (3000, 1), (700, 1), (40, 1)]
    case = sw.make_case(spec, window, hq, hk, d, torch.bfloat16, seed=4)
    case.kv_layer, case.q = case.kv_layer.cuda(), case.q.cuda()
    case.k, case.v = case.k.cuda(), case.v.cuda()
    meta = sw.AttentionMetadata.build(case.seqs, sw.BS, "cuda", window=window)
    backend = FlashInferBackend("cuda")
    backend.plan(meta, sw.AttentionShape(hq, hk, d, torch.bfloat16))
    layer = case.kv_layer.clone()
    layer[sw.NULL_PAGE] = torch.finfo(torch.bfloat16).max
    out = backend.forward(case.q, case.k, case.v, layer).cpu()
    case.q = case.q.cpu()
    sw.check_against_reference(out, case)


@pytest.mark.parametrize("window", [0, 64])
def test_flashinfer_logits_soft_cap(window: int) -> None:
    """Gemma 2's attention softcap through ``logits_soft_cap`` (cap * tanh(x / cap) of the
    scaled scores), with and without a window: the dense capped reference."""
    import test_sliding_window as sw

    hq, hk, d = 8, 4, 256  # Gemma 2's head size
    spec = [(900, 200), (3000, 1), (700, 1), (40, 1)]
    case = sw.make_case(spec, window, hq, hk, d, torch.bfloat16, seed=5)
    case.softcap = 1.5
    case.kv_layer, case.q = case.kv_layer.cuda(), case.q.cuda() * 4.0
    case.k, case.v = case.k.cuda(), case.v.cuda()
    meta = sw.AttentionMetadata.build(case.seqs, sw.BS, "cuda", window=window)
    backend = FlashInferBackend("cuda")
    backend.plan(meta, sw.AttentionShape(hq, hk, d, torch.bfloat16, softcap=case.softcap))
    out = backend.forward(case.q, case.k, case.v, case.kv_layer.clone()).cpu()
    case.q = case.q.cpu()
    sw.check_against_reference(out, case)


def test_flashinfer_fixed_split_is_batch_invariant() -> None:
    """The same sequence alone and among others: bitwise equal with the fixed split."""
    hq, hk, d = 8, 4, 64
    mine = (3000, 1)
    results = []
    for spec in ([mine], [(300, 1), (0, 40), mine], [mine, (5000, 1), (90, 1), (700, 33)]):
        case = make_case(spec, hq, hk, d, seed=11, device="cuda", dtype=torch.bfloat16)
        got, _ = run(FlashInferBackend("cuda", batch_invariant=True), case, hq, hk, True)
        results.append(got[spec.index(mine)])
    for r in results[1:]:
        assert torch.equal(results[0], r)


def test_demo_model_flashinfer_vs_torch() -> None:
    from prefixcache.engine.memory.kv_cache import KVCache
    from prefixcache.engine.model.loader import load_model
    from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

    loaded = load_model("demo", dtype="bfloat16", device="cuda")
    gen = torch.Generator().manual_seed(3)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (300, 77, 1)]
    tables = [list(range(0, 20)), list(range(20, 26)), [30]]
    logits = {}
    for name, be in (("flashinfer", FlashInferBackend("cuda")), ("torch", TorchBackend())):
        runner = ModelRunner(loaded, KVCache(loaded.kv_cache_spec(16), 64), be)
        first = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        nxt = first.argmax(-1).tolist()
        batch = [BatchEntry([n], len(p), t) for n, p, t in zip(nxt, prompts, tables, strict=True)]
        logits[name] = torch.cat([first, runner.execute(batch)])
    torch.testing.assert_close(logits["flashinfer"], logits["torch"], atol=0.15, rtol=0.05)


@pytest.mark.parametrize("page_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_demo_model_on_fp8_pages_flashinfer_vs_torch(page_dtype: torch.dtype) -> None:
    """--kv-cache-dtype fp8: FlashInfer's fp8 KV (scale 1) against the torch reference reading
    the same rounded pages, then against bf16 pages (close, not equal: the rounding)."""
    from prefixcache.engine.memory.kv_cache import KVCache
    from prefixcache.engine.model.loader import load_model
    from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

    loaded = load_model("demo", dtype="bfloat16", device="cuda")
    gen = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (300, 40)
    ]
    tables = [list(range(0, 20)), list(range(20, 24))]
    logits = {}
    for name, be, pages in (
        ("flashinfer", FlashInferBackend("cuda"), page_dtype),
        ("torch", TorchBackend(), page_dtype),
        ("bf16", TorchBackend(), None),
    ):
        runner = ModelRunner(loaded, KVCache(loaded.kv_cache_spec(16, pages), 64), be)
        first = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        nxt = first.argmax(-1).tolist()
        batch = [BatchEntry([n], len(p), t) for n, p, t in zip(nxt, prompts, tables, strict=True)]
        logits[name] = torch.cat([first, runner.execute(batch)]).float()
    torch.testing.assert_close(logits["flashinfer"], logits["torch"], atol=0.15, rtol=0.05)
    torch.testing.assert_close(logits["flashinfer"], logits["bf16"], atol=1.0, rtol=0.2)
