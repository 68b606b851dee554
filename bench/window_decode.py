"""Decode attention at a 4K context with a sliding window of 512 against full attention, per
backend (the batch-invariant row kernel, the split kernel, the torch reference): one layer's
``plan`` + ``forward`` over scattered pages, the pages before each window mapped to the null
page as a sliding layer's table maps them. Prints each time and the ratio window / full (an
ideal kernel reads 512 of 4096 keys: about 0.125 plus fixed costs), and the CPU. One thread
by default (``--threads``): on a shared 2-core box a two-thread team's figures swing.

    .venv/bin/python bench/window_decode.py [--threads 2] [--batch 8] [--json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from row_decode import per_call_ms

from prefixcache.engine.attention import (
    AttentionMetadata,
    AttentionShape,
    SeqSpec,
    cpu_kernels,
    row_kernels,
)
from prefixcache.engine.attention.backend import AttentionBackend
from prefixcache.engine.attention.cpu_backend import CpuKernelBackend
from prefixcache.engine.attention.split_backend import SplitKernelBackend
from prefixcache.engine.attention.torch_backend import TorchBackend
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.progress import progress_iter

BS, HQ, HK, D = 16, 8, 2, 64
CONTEXT, WINDOW = 4096, 512


def decode_ms(backend: AttentionBackend, batch: int, window: int, dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    pages = CONTEXT // BS + 1
    kv = torch.randn(1 + batch * pages, 2, BS, HK, D, generator=gen).to(dtype)
    order = (torch.randperm(batch * pages, generator=gen) + 1).tolist()  # page 0: null
    seqs = []
    for b in range(batch):
        table = order[b * pages : (b + 1) * pages]
        if window:  # pages wholly before the window: the null page
            skip = (CONTEXT + 1 - window) // BS
            table[:skip] = [0] * skip
        seqs.append(SeqSpec(CONTEXT, 1, table))
    meta = AttentionMetadata.build(seqs, BS, "cpu", window=window)
    shape = AttentionShape(HQ, HK, D, dtype)
    backend.prepare(shape, torch.device("cpu"))
    q = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    k = torch.randn(batch, HK, D, generator=gen).to(dtype)

    def step() -> None:
        backend.plan(meta, shape)
        backend.forward(q, k, k, kv)

    return per_call_ms(step, reps=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backends: list[tuple[str, Callable[[], AttentionBackend]]] = [("torch", TorchBackend)]
    if row_kernels.load_rows() is not None:
        backends.insert(0, ("cpu (row kernel)", CpuKernelBackend))
    if cpu_kernels.load() is not None:
        backends.insert(1, ("cpu-split", SplitKernelBackend))
    cpu = cpu_model_name()
    print(f"CPU: {cpu}, {args.threads} thread(s); decode of {args.batch} sequences at "
          f"{CONTEXT} keys, window {WINDOW} vs full, bf16, hq {HQ} hk {HK} d {D}")  # fmt: skip
    rows = []
    for name, make in progress_iter(backends, desc="backends"):
        full = decode_ms(make(), args.batch, 0, torch.bfloat16)
        windowed = decode_ms(make(), args.batch, WINDOW, torch.bfloat16)
        rows.append({"backend": name, "full_ms": full, "window_ms": windowed})
        print(
            f"{name:18s} full {full:8.3f} ms   window {windowed:8.3f} ms   "
            f"window/full {windowed / full:.3f}",
            flush=True,
        )
    if args.json:
        print(json.dumps({"cpu": cpu, "threads": args.threads, "batch": args.batch, "rows": rows}))


if __name__ == "__main__":
    main()
