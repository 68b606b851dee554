"""Decode attention at long contexts: the batch-invariant row kernel (the default) against the
split decode kernel it replaced (what ``--no-batch-invariance`` still runs), one layer call
over scattered pages; prints each time and the ratio row / split (below 1: the row kernel is
faster). One thread by default (``--threads``): on a shared 2-core box a two-thread OpenMP
team's figures swing with whatever else runs.

    .venv/bin/python bench/row_decode.py [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from prefixcache.engine.attention import cpu_kernels, row_kernels

CASES = [(1, 16000, 8, 2), (16, 1100, 9, 3), (32, 4000, 8, 2)]  # (sequences, keys, hq, hk)


def per_call_ms(fn: Callable[[], object], reps: int = 20, runs: int = 5) -> float:
    """Median over ``runs`` timed runs of ``reps`` calls each (after one untimed call)."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if cpu_kernels.load() is None or row_kernels.load_rows() is None:
        raise SystemExit(f"the CPU kernels do not load here: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, length, hq, hk in CASES:
        d, bs = 64, 16
        width = length // bs + 1
        kv = torch.randn(b * width + 8, 2, bs, hk, d, generator=gen).bfloat16()
        pages = torch.randperm(kv.shape[0], generator=gen).to(torch.int32)
        tables = pages[: b * width].view(b, width).contiguous()
        lens = torch.full((b,), length, dtype=torch.int64)
        q = torch.randn(b, hq, d, generator=gen).bfloat16()
        qo = torch.arange(b + 1, dtype=torch.int64)
        split = per_call_ms(
            lambda q=q, kv=kv, t=tables, n=lens: cpu_kernels.paged_decode(q, kv, t, n, 0.125)
        )
        row = per_call_ms(
            lambda q=q, kv=kv, t=tables, o=qo, n=lens: row_kernels.row_attention(
                q, kv, t, o, n, 0.125
            )
        )
        rows.append(
            {"seqs": b, "keys": length, "hq": hq, "hk": hk, "split_ms": split, "row_ms": row}
        )
        print(
            f"decode {b:2d} x {length:5d} keys (hq {hq}, hk {hk}): split {split:.3f} ms, "
            f"row {row:.3f} ms, row/split {row / split:.2f}",
            flush=True,
        )
    if args.json:
        print(json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
