"""The floor: a decode step and a cold prefill against what this machine's memory and GEMM
units allow.

For each case, floor = max(bytes read / measured DRAM bandwidth, FLOPs / measured GEMM peak),
both measured here in the same run (``torch.sum`` over a 1 GiB tensor; square GEMMs of the
model's dtype). Bytes read count every linear weight and the LM head once per forward pass, and
for decode each sequence's keys and values; FLOPs are bench/flops.py's (linear layers, causal
attention, one LM-head row per sequence). ``time / floor`` is how far the engine is from it,
and which bound sets the floor says where the gap is.

    .venv/bin/python bench/floor.py [--model demo] [--seqs 32 --context 512 --prefill 4096] [--json]

The default model is a random Llama at the serving bench checkpoint's sizes (hidden 512, 8
layers, 8/2 heads of 64, intermediate 1408; bench/make_bench_model.py) with the demo
tokenizer's vocabulary; ``--model smollm2`` (or any path) measures a real one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from flops import linear_flops_per_token, prefill_flops
from prefill import prefill, sized_model

from prefixcache.engine.attention import create_backend
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.model_config import ModelConfig
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

BLOCK = 16
BENCH_SIZES = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 1408}


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def dram_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes/s that a full-core reduction streams from memory (far larger than any cache)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return x.numel() * 4 / best_of(lambda: x.sum(), repeat)


def gemm_peak(dtype: torch.dtype, n: int = 2048, repeat: int = 5) -> float:
    """FLOP/s of a square GEMM at ``dtype`` (the kind of GEMM a prefill runs)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_of(lambda: a @ b, repeat)


def weight_bytes(c: ModelConfig, elem: int) -> int:
    """Linear weights and the LM head, read once per forward pass (norms are noise)."""
    return (linear_flops_per_token(c) // 2 + c.hidden_size * c.vocab_size) * elem


def kv_bytes(c: ModelConfig, tokens: int, elem: int) -> int:
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * tokens * elem


def decode_step(runner: ModelRunner, seqs: int, context: int) -> Callable[[], object]:
    """One decode step of ``seqs`` sequences, each with ``context`` tokens in its pages."""
    blocks = -(-(context + 1) // BLOCK)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    entries = [BatchEntry([7 + i], context, tables[i]) for i in range(seqs)]
    return lambda: runner.execute(entries)


def case(name: str, seconds: float, flops: int, nbytes: int, bw: float, peak: float) -> dict:
    memory_s, compute_s = nbytes / bw, flops / peak
    floor = max(memory_s, compute_s)
    return {
        "case": name,
        "ms": round(seconds * 1e3, 2),
        "floor_ms": round(floor * 1e3, 2),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "memory_ms": round(memory_s * 1e3, 2),
        "compute_ms": round(compute_s * 1e3, 2),
        "gb_read": round(nbytes / 1e9, 3),
        "gflop": round(flops / 1e9, 2),
        "time_over_floor": round(seconds / floor, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--sizes", choices=["bench", "model"], default="bench", help="see above")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--seqs", type=int, default=32, help="sequences in the decode step")
    ap.add_argument("--context", type=int, default=512, help="tokens each decoding sequence holds")
    ap.add_argument("--prefill", type=int, default=4096, help="cold prefill tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (the engine's default)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0, help="bandwidth probe size")
    ap.add_argument("--gemm", type=int, default=2048, help="GEMM peak probe size")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    loaded: LoadedModel = load_model(args.model, dtype=args.dtype, device="cpu")
    if args.sizes == "bench" and args.model == "demo":
        for key, value in BENCH_SIZES.items():
            setattr(args, key, value)
        loaded = sized_model(loaded, args)
    c, dtype = loaded.config, loaded.dtype
    elem = torch.empty((), dtype=dtype).element_size()
    bw = dram_bandwidth(args.gib, args.repeat)
    peak = gemm_peak(dtype, args.gemm, args.repeat)

    seq_blocks = -(-(args.context + 1) // BLOCK)
    num_blocks = max(args.seqs * seq_blocks, -(-args.prefill // BLOCK)) + 1
    backend = create_backend("auto", "cpu")
    runner = ModelRunner(loaded, KVCache(loaded.kv_cache_spec(BLOCK), num_blocks), backend)
    decode_s = best_of(decode_step(runner, args.seqs, args.context), args.repeat)
    decode_flops = args.seqs * (
        linear_flops_per_token(c)
        + 2 * 2 * c.num_heads * c.head_dim * (args.context + 1)
        + 2 * c.hidden_size * c.vocab_size
    )
    decode_bytes = weight_bytes(c, elem) + kv_bytes(c, args.seqs * (args.context + 1), elem)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, c.vocab_size, (args.prefill,), generator=gen).tolist()
    prefill_s = statistics.median(
        best_of(lambda: prefill(runner, tokens, 0, args.chunk), 1) for _ in range(args.repeat)
    )
    passes = -(-args.prefill // args.chunk) if args.chunk > 0 else 1
    prefill_bytes = passes * weight_bytes(c, elem) + kv_bytes(c, args.prefill, elem)

    rows = [
        case(
            f"decode {args.seqs} seqs x {args.context}",
            decode_s,
            decode_flops,
            decode_bytes,
            bw,
            peak,
        ),
        case(
            f"cold prefill {args.prefill}",
            prefill_s,
            prefill_flops(c, 0, args.prefill),
            prefill_bytes,
            bw,
            peak,
        ),
    ]
    result = {
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "model": loaded.name,
        "dtype": args.dtype,
        "backend": backend.name,
        "dram_gb_per_s": round(bw / 1e9, 2),
        "gemm_gflop_per_s": round(peak / 1e9, 1),
        "decode_over_floor": rows[0]["time_over_floor"],
        "prefill_over_floor": rows[1]["time_over_floor"],
        "rows": rows,
    }
    print(
        f"{result['cpu']}, {result['threads']} threads; {loaded.name} {args.dtype}, "
        f"{backend.name} backend"
    )
    print(f"measured: DRAM {bw / 1e9:.1f} GB/s, {args.dtype} GEMM {peak / 1e9:.0f} GFLOP/s")
    for r in rows:
        print(
            f"{r['case']:28s} {r['ms']:8.2f} ms  floor {r['floor_ms']:7.2f} ms ({r['bound']}: "
            f"{r['gb_read']} GB, {r['gflop']} GFLOP)  time/floor {r['time_over_floor']:.2f}"
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
