"""On CUDA: FlashInfer backend vs torch backend (prefill, decode, cascade), then cascade timing.

1. Attention outputs of both backends on the same paged KV (bf16 by default): a ragged prefill
   batch with cached prefixes and partial pages, a decode batch, and a cascade decode group.
2. The demo model end to end through ModelRunner with each backend (logits, greedy agreement).
3. Decode step timing, batch 32 over an 8K shared prefix: FlashInfer without vs with cascade.

Kernels are JIT-compiled on first use (needs nvcc); the whole run should take under 5 minutes.
On a machine without CUDA it prints why and exits with status 0 (nothing to check).

    .venv/bin/python bench/gpu_check.py [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from prefixcache.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    create_backend,
    plan_step_order,
)
from prefixcache.engine.model.progress import progress_iter

BS = 16
HQ, HK, D = 8, 4, 64  # the demo model's attention shape


def run_backend(
    backend: AttentionBackend,
    seqs: list[SeqSpec],
    kv_layer: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cascade: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Outputs in the caller's sequence order (rows of q/k/v are in that order too)."""
    order, groups = plan_step_order(seqs, BS, cascade)
    ordered = [seqs[i] for i in order]
    meta = AttentionMetadata.build(ordered, BS, q.device, groups)
    starts, pos = [], 0
    for s in seqs:
        starts.append(pos)
        pos += s.num_new
    rows = torch.tensor(
        [starts[i] + j for i in order for j in range(seqs[i].num_new)], device=q.device
    )
    backend.plan(meta, AttentionShape(HQ, HK, D, dtype))
    out = backend.forward(q[rows], k[rows], v[rows], kv_layer)
    result = torch.empty_like(out)
    result[rows] = out
    torch.cuda.synchronize()
    return result


def make_case(
    specs: list[tuple[int, int]], shared: int, dtype: torch.dtype, seed: int
) -> tuple[list[SeqSpec], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rnd = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shared_blocks = list(range(shared // BS))
    next_block = len(shared_blocks)
    seqs = []
    for start, n in specs:
        need = -(-(start + n) // BS) - len(shared_blocks)
        own = list(range(next_block, next_block + need))
        rnd.shuffle(own)
        next_block += need
        seqs.append(SeqSpec(start, n, shared_blocks + own))
    kv = torch.randn(next_block + 1, 2, BS, HK, D, device="cuda", generator=gen).to(dtype)
    t = sum(n for _, n in specs)
    q = torch.randn(t, HQ, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(t, HK, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(t, HK, D, device="cuda", generator=gen).to(dtype)
    return seqs, kv, q, k, v


def compare(name: str, a: torch.Tensor, b: torch.Tensor, atol: float) -> dict:
    diff = float((a.float() - b.float()).abs().max())
    ok = diff <= atol
    print(f"{name:34s} max|diff| {diff:.3e}  (atol {atol})  {'OK' if ok else 'FAIL'}")
    return {"check": name, "max_diff": diff, "atol": atol, "ok": ok}


def timed(fn, repeat: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--skip-model", action="store_true", help="skip the end-to-end model check")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available on this machine; nothing to check "
            "(the flashinfer backend only runs on CUDA)."
        )
        if args.json:
            print(json.dumps({"skipped": True, "reason": "cuda not available"}))
        return 0
    try:
        import flashinfer
    except ImportError:
        print("gpu_check: flashinfer is not installed: pip install 'prefixcache[gpu]'")
        return 1
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    fi = create_backend("flashinfer", "cuda")
    tb = create_backend("torch", "cuda")
    checks = []
    atol = 2e-2 if dtype == torch.bfloat16 else 5e-3

    # 1a. Prefill: fresh, cached prefix, partial pages, plus a few decodes in the same step.
    specs = [(0, 37), (16, 16), (45, 100), (130, 7), (0, 1), (63, 1), (200, 1)]
    seqs, kv, q, k, v = make_case(specs, 0, dtype, seed=1)
    o_fi = run_backend(fi, seqs, kv.clone(), q, k, v, False, dtype)
    o_t = run_backend(tb, seqs, kv.clone(), q, k, v, False, dtype)
    checks.append(compare("prefill+decode: flashinfer vs torch", o_fi, o_t, atol))

    # 1b/c. Decode group over a shared prefix: plain and cascade, both backends.
    b, shared = 8, 1024
    specs = [(shared + 5 * i + 1, 1) for i in range(b)]
    seqs, kv, q, k, v = make_case(specs, shared, dtype, seed=2)
    o_fi_plain = run_backend(fi, seqs, kv.clone(), q, k, v, False, dtype)
    o_fi_casc = run_backend(fi, seqs, kv.clone(), q, k, v, True, dtype)
    o_t_casc = run_backend(tb, seqs, kv.clone(), q, k, v, True, dtype)
    checks.append(compare("decode: flashinfer vs torch cascade", o_fi_plain, o_t_casc, atol))
    checks.append(compare("cascade vs plain (flashinfer)", o_fi_casc, o_fi_plain, atol))
    checks.append(compare("cascade: flashinfer vs torch", o_fi_casc, o_t_casc, atol))

    # 2. The demo model end to end.
    if not args.skip_model:
        from prefixcache.engine.memory.kv_cache import KVCache
        from prefixcache.engine.model.loader import load_model
        from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

        loaded = load_model("demo", dtype=dtype, device="cuda")
        gen = torch.Generator().manual_seed(3)
        prompts = [
            torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
            for n in (300, 77, 1)
        ]
        logits = {}
        for name, be in (("flashinfer", fi), ("torch", tb)):
            runner = ModelRunner(loaded, KVCache(loaded.kv_cache_spec(BS), 64), be)
            tables = [list(range(0, 20)), list(range(20, 26)), [30]]
            first = runner.execute(
                [BatchEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
            )
            nxt = first.argmax(-1).tolist()
            step = runner.execute(
                [BatchEntry([n], len(p), t) for n, p, t in zip(nxt, prompts, tables, strict=True)]
            )
            logits[name] = torch.cat([first, step])
        checks.append(
            compare(
                "model logits: flashinfer vs torch", logits["flashinfer"], logits["torch"], 0.15
            )
        )
        agree = float(
            (logits["flashinfer"].argmax(-1) == logits["torch"].argmax(-1)).float().mean()
        )
        print(f"{'model greedy agreement':34s} {agree:.2f}")

    # 3. Timing: batch B decoding over an 8K shared prefix.
    specs = [(args.prefix + 32, 1)] * args.batch
    seqs, kv, q, k, v = make_case(specs, args.prefix, dtype, seed=4)
    timing = {}
    configs = (
        ("flashinfer_plain", fi, False),
        ("flashinfer_cascade", fi, True),
        ("torch_plain", tb, False),
        ("torch_cascade", tb, True),
    )
    for name, be, casc in progress_iter(configs, "decode attention timings"):
        order, groups = plan_step_order(seqs, BS, casc)
        meta = AttentionMetadata.build([seqs[i] for i in order], BS, "cuda", groups)
        be.plan(meta, AttentionShape(HQ, HK, D, dtype))
        layer = kv.clone()
        timing[name] = timed(lambda be=be, layer=layer: be.forward(q, k, v, layer))
    for name in timing:  # after the bar is done
        print(f"decode attention {name:20s} {timing[name] * 1e6:9.1f} us per layer")
    speedup = timing["flashinfer_plain"] / timing["flashinfer_cascade"]
    print(f"flashinfer cascade speedup (batch {args.batch}, {args.prefix} shared): {speedup:.2f}x")
    elapsed = time.perf_counter() - t_start
    ok = all(c["ok"] for c in checks)
    print(
        f"gpu_check {'passed' if ok else 'FAILED'} in {elapsed:.1f} s "
        f"(flashinfer {flashinfer.__version__}, {torch.cuda.get_device_name()})"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "checks": checks,
                    "decode_s": timing,
                    "cascade_speedup": speedup,
                    "elapsed_s": elapsed,
                }
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
