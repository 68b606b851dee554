"""The batch-invariant row attention kernel against the torch path it replaces, per dtype.

The row kernel (``row_kernels.row_attention``) is what the engine runs at its default dtype on
every CPU it builds for, fp32 included (the AVX2 build's native 256-bit path). The baseline is
what ``PREFIXCACHE_CPU_KERNELS=0`` runs for the same step (the torch reference backend's ops):

- cold prefill: causal attention of L new tokens over their own K/V (torch's CPU flash
  attention on contiguous K/V, as ``dense_attention`` calls it);
- warm suffix: S new tokens after C cached ones: the cached pages gathered, attended without
  a mask, the new tokens causally, the two states merged by LSE;
- decode: B sequences, one query each, over their scattered pages: gathered, then one padded
  call.

Shapes are SmolLM2's (9 query / 3 KV heads of 64), Gemma 3's (4 / 1 of 256) and Phi-3 mini's
(32 / 32 of 96; ``--head-dim 96`` runs those alone). Prints
milliseconds (median of wall time) and the ratio row / torch (below 1: the row kernel is
faster), with the CPU named. ``--softcap CAP`` also times the row kernel with Gemma 2's score
softcap (``CAP * tanh(s / CAP)`` on every score) and prints its cost: capped / plain.

    .venv/bin/python bench/row_attention.py [--threads 2] [--scale 1.0] [--softcap 50]
        [--head-dim 96] [--json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from row_decode import per_call_ms

from prefixcache.engine.attention import row_kernels
from prefixcache.engine.attention.torch_ops import (
    dense_attention,
    merge_states,
    padded_decode_attention,
)
from prefixcache.engine.kernels.cpu_features import cpu_flags, cpu_model_name
from prefixcache.engine.model.progress import progress_iter

BS = 16
# (case, sequences, new tokens per sequence, cached tokens per sequence, hq, hk, d)
CASES = [
    ("prefill", 1, 2048, 0, 9, 3, 64),
    ("prefill", 1, 1024, 0, 4, 1, 256),
    ("warm suffix", 1, 64, 2048, 9, 3, 64),
    ("warm suffix", 1, 64, 2048, 4, 1, 256),
    ("decode", 32, 1, 1100, 9, 3, 64),
    ("decode", 1, 1, 16000, 9, 3, 64),
    ("decode", 16, 1, 2048, 4, 1, 256),
    ("decode", 1, 1, 8000, 4, 1, 256),  # one KV head: its key partitions split over threads
    ("prefill", 1, 1024, 0, 32, 32, 96),  # Phi-3 mini: 32 heads of 96, no GQA
    ("warm suffix", 1, 64, 2048, 32, 32, 96),
    ("decode", 8, 1, 2048, 32, 32, 96),
]


def gather(kv: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole pages, as the torch backend gathers them."""
    n, _, bs, hk, d = kv.shape
    pages = kv.view(n * 2, bs * hk * d)
    rows = blocks.long() * 2
    k = pages.index_select(0, rows).view(-1, hk, d)
    v = pages.index_select(0, rows + 1).view(-1, hk, d)
    return k, v


def measure(
    dtype: torch.dtype,
    case: tuple,
    gen: torch.Generator,
    scale_len: float,
    reps: int,
    softcap: float = 0.0,
) -> dict:
    name, b, new, cached, hq, hk, d = case
    new = max(1, int(new * scale_len)) if name != "decode" else 1
    cached = int(cached * scale_len)
    keys = cached + new
    width = -(-keys // BS)
    kv = torch.randn(b * width + 1, 2, BS, hk, d, generator=gen).to(dtype)
    tables = torch.randperm(kv.shape[0], generator=gen)[: b * width].to(torch.int32)
    tables = tables.view(b, width).contiguous()
    q = torch.randn(b * new, hq, d, generator=gen).to(dtype)
    qo = torch.arange(0, b * new + 1, new, dtype=torch.int64)
    lens = torch.full((b,), keys, dtype=torch.int64)
    sm = 1.0 / math.sqrt(d)

    def row() -> object:
        return row_kernels.row_attention(q, kv, tables, qo, lens, sm)

    def row_capped() -> object:
        return row_kernels.row_attention(q, kv, tables, qo, lens, sm, softcap=softcap)

    # A prefill's new K/V come from the step itself (contiguous); only cached pages are gathered.
    all_k, all_v = gather(kv, tables.reshape(-1))
    new_k, new_v = all_k[cached:keys].contiguous(), all_v[cached:keys].contiguous()
    cached_blocks = tables.reshape(-1)[: -(-cached // BS)]

    def reference() -> object:
        if name == "decode":
            k, v = gather(kv, tables.reshape(-1))
            k, v = k.view(b, width * BS, hk, d), v.view(b, width * BS, hk, d)
            return padded_decode_attention(q, k, v, lens, sm)
        o, lse = dense_attention(q, new_k, new_v, sm, causal=True)
        if cached:
            ck, cv = gather(kv, cached_blocks)
            o_c, lse_c = dense_attention(q, ck[:cached], cv[:cached], sm, causal=False)
            o, lse = merge_states(o_c, lse_c, o, lse)
        return o

    expected = reference()
    err = row().float() - (expected[0] if name == "decode" else expected).float()
    row_ms = per_call_ms(row, reps=reps, runs=5)
    torch_ms = per_call_ms(reference, reps=reps, runs=5)
    capped = {}
    if softcap:
        capped_ms = per_call_ms(row_capped, reps=reps, runs=5)
        capped = {"capped_ms": round(capped_ms, 3), "capped_over_row": round(capped_ms / row_ms, 3)}
    return {
        **capped,
        "case": name,
        "dtype": str(dtype).removeprefix("torch."),
        "seqs": b,
        "new": new,
        "keys": keys,
        "hq": hq,
        "hk": hk,
        "d": d,
        "row_ms": round(row_ms, 3),
        "torch_ms": round(torch_ms, 3),
        "row_over_torch": round(row_ms / torch_ms, 3),
        "max_abs_diff": float(err.abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every token count")
    ap.add_argument("--reps", type=int, default=5, help="calls per timed run")
    ap.add_argument("--softcap", type=float, default=0.0, help="also time this score softcap")
    ap.add_argument("--head-dim", type=int, nargs="*", help="only the cases of these head dims")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if (reason := row_kernels.row_unavailable_reason()) or row_kernels.load_rows() is None:
        print(f"batch-invariant attention kernel unavailable here: {reason or 'build failed'}")
        if args.json:
            print(json.dumps({"available": False, "cpu": cpu_model_name()}))
        return
    torch.set_num_threads(args.threads)
    native_bf16 = "avx512_bf16" in cpu_flags()
    # bf16 on a CPU without it runs emulated (slower than torch by design): measured only
    # where it is native, which is where the engine picks bf16 by default.
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16 else [])
    gen = torch.Generator().manual_seed(0)
    cases = [c for c in CASES if not args.head_dim or c[-1] in args.head_dim]
    jobs = [(dt, c) for dt in dtypes for c in cases]
    rows = []
    for dt, case in progress_iter(jobs, "row kernel vs torch"):
        r = measure(dt, case, gen, args.scale, args.reps, args.softcap)
        rows.append(r)
        capped = (
            f", softcapped {r['capped_ms']:.3f} ms: {r['capped_over_row']:.2f}x"
            if args.softcap
            else ""
        )
        print(
            f"{r['dtype']:8s} {r['case']:11s} {r['seqs']:2d} x {r['new']:5d} new over "
            f"{r['keys']:5d} keys (hq {r['hq']}, hk {r['hk']}, d {r['d']}): row "
            f"{r['row_ms']:.3f} ms, torch {r['torch_ms']:.3f} ms, row/torch "
            f"{r['row_over_torch']:.2f} (max |diff| {r['max_abs_diff']:.1e}){capped}",
            flush=True,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "available": True,
                    "cpu": cpu_model_name(),
                    "avx512_bf16": native_bf16,
                    "target": row_kernels.row_target(),
                    "threads": args.threads,
                    "softcap": args.softcap,
                    "rows": rows,
                }
            )
        )


if __name__ == "__main__":
    main()
