"""Batched decode over a shared prefix: one full model step with and without cascade attention.

B sequences share a P-token prefix (whole blocks, as the prefix cache shares them) and each has
its own U-token suffix; every step decodes one token for each. Without cascade every sequence
gathers and reads the prefix KV itself; with cascade the group reads it once.

The cached KV is filled with random values instead of running the prefix through the model
(attention and linear costs do not depend on the values); --check verifies that cascade and
non-cascade logits agree. The headline is the full-step ratio (linear layers included); the
attention-only ratio is printed too.

    .venv/bin/python bench/shared_decode.py --batch 32 --prefix 8192 [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prefixcache.engine.attention import (
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    create_backend,
    plan_step_order,
)
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_bar
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

BLOCK = 16


CLOCK = time.perf_counter  # --clock cpu: time.thread_time (with --threads 1, the work alone)


def timed(fn, repeat: int, sync) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        sync()
        t0 = CLOCK()
        fn()
        sync()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--prefix", type=int, default=8192, help="shared tokens (rounded down to blocks)"
    )
    ap.add_argument("--suffix", type=int, default=32, help="each sequence's own cached tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        global CLOCK
        CLOCK = time.thread_time

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    cfg = loaded.config
    shared_blocks = args.prefix // BLOCK
    prefix = shared_blocks * BLOCK
    own_blocks = -(-(args.suffix + 1) // BLOCK)
    num_blocks = shared_blocks + args.batch * own_blocks
    cache = KVCache(loaded.kv_cache_spec(BLOCK), num_blocks)
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:  # stand-in KV with realistic magnitude
        layer.copy_((torch.randn(layer.shape, generator=gen) * 0.5).to(layer.dtype))

    start = prefix + args.suffix
    batch = []
    for b in range(args.batch):
        own = [shared_blocks + b * own_blocks + j for j in range(own_blocks)]
        token = int(torch.randint(0, cfg.vocab_size, (1,), generator=gen))
        batch.append(BatchEntry([token], start, list(range(shared_blocks)) + own))

    backend = create_backend(args.backend, args.device)
    plans: list = []  # the cascade runner's attention plans
    runners = {
        c: ModelRunner(
            loaded, cache, backend, enable_cascade=c, on_plan=plans.append if c else None
        )
        for c in (False, True)
    }

    def sync() -> None:
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()

    bar = progress_bar("decode steps, attention: plain and cascade", 4)
    step = {}
    for c in runners:
        step[c] = timed(lambda c=c: runners[c].execute(batch), args.repeat, sync)
        bar.update()
    meta = plans[-1] if plans else None
    assert meta is not None and meta.cascade_groups, "the batch did not form a cascade group"

    # Attention only: one layer's backend.forward, times the number of layers.
    shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    seqs = [SeqSpec(e.start_pos, 1, e.block_table) for e in batch]
    q = torch.randn(args.batch, cfg.num_heads, cfg.head_dim, generator=gen).to(
        device=loaded.device, dtype=loaded.dtype
    )
    kv = torch.randn(args.batch, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(q)
    attn = {}
    outs = {}
    for c in (False, True):
        order, groups = plan_step_order(seqs, BLOCK, c)
        m = AttentionMetadata.build([seqs[i] for i in order], BLOCK, loaded.device, groups)
        backend.plan(m, shape)

        def run(c: bool = c) -> None:
            outs[c] = backend.forward(q, kv, kv, cache.layers[0])

        attn[c] = timed(run, args.repeat, sync) * cfg.num_layers
        bar.update()
    bar.close()

    result = {
        "model": loaded.name,
        "dtype": args.dtype,
        "device": str(loaded.device),
        "backend": backend.name,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "prefix": prefix,
        "suffix": args.suffix,
        "step_s_no_cascade": round(step[False], 5),
        "step_s_cascade": round(step[True], 5),
        "speedup": round(step[False] / step[True], 3),
        "attention_s_no_cascade": round(attn[False], 5),
        "attention_s_cascade": round(attn[True], 5),
        "attention_speedup": round(attn[False] / attn[True], 3),
    }
    if args.check:
        a = runners[True].execute(batch)
        b = runners[False].execute(batch)
        result["max_logit_diff"] = float((a - b).abs().max())
        result["max_attention_diff"] = float((outs[True] - outs[False]).abs().max())

    print(
        f"model {loaded.name} {args.dtype} on {loaded.device} ({backend.name} backend): "
        f"batch {args.batch} decoding over a {prefix}-token shared prefix (+{args.suffix} own)"
    )
    print(f"decode step without cascade: {step[False] * 1e3:9.2f} ms")
    print(
        f"decode step with cascade   : {step[True] * 1e3:9.2f} ms   "
        f"speedup {result['speedup']:.2f}x (full step)"
    )
    print(
        f"attention only (x{cfg.num_layers} layers): {attn[False] * 1e3:.2f} ms -> "
        f"{attn[True] * 1e3:.2f} ms, {result['attention_speedup']:.2f}x"
    )
    if args.check:
        print(f"max |logits cascade - plain| = {result['max_logit_diff']:.2e}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
