"""The engine's GEMMs: does a row's result depend on its batch, and what does invariance cost?

For each layer shape of the serving models (SmolLM2-135M: hidden 576, FFN 1536, vocab 49,152;
the 55M bench Llama: 512 / 1,408), bf16 and fp32: how many row counts M in 1..2,048 give some
row a different result than that row alone, for torch's path (oneDNN's packed bf16 GEMM,
MKL's fp32 ``linear``) and for ``cpu_gemm`` (the engine's default); then the time per call at
M = 1, 8, 64, 512 for both and the ratio ``cpu_gemm / torch`` (below 1: ours is faster).

    .venv/bin/python bench/gemm_invariance.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from prefixcache.engine.kernels import cpu_gemm
from prefixcache.engine.kernels.cpu_features import cpu_flags, cpu_model_name
from prefixcache.engine.kernels.linear import Gemm

SHAPES = [(576, 1728), (1536, 576), (576, 49152), (512, 1920), (1408, 512)]  # (in, out)
ROW_COUNTS = [*range(2, 70), 127, 128, 129, 255, 256, 257, 512, 1000, 2048]


def varying_row_counts(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Row counts M for which some of the first 64 rows differ from that row computed alone."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(64)])
    return sum(not torch.equal(fn(x[:m])[: min(m, 64)], alone[: min(m, 64)]) for m in ROW_COUNTS)


def per_call_ms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    fn(x)
    reps = 20 if x.shape[0] < 100 else 5
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn(x)
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not cpu_gemm.available():
        raise SystemExit("cpu_gemm does not load here (needs AVX512_BF16 and g++)")
    flags = cpu_flags()
    isa = "AVX512_BF16" if "avx512_bf16" in flags else "AVX-512"
    amx = "AMX on" if cpu_gemm.amx_available() else "AMX off"
    print(f"CPU: {cpu_model_name()}, {isa}, {amx}; threads {torch.get_num_threads()}")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
            x = torch.randn(2048, k, generator=gen).to(dtype)
            ours = cpu_gemm.PackedLinear(w, None)
            theirs = Gemm(w, None, batch_invariant=False)
            row = {
                "shape": f"{k}x{n}",
                "dtype": str(dtype).removeprefix("torch."),
                "kernel": ours.kernel,
                "torch_varying_M": varying_row_counts(theirs, x),
                "ours_varying_M": varying_row_counts(ours, x),
            }
            for m in (1, 8, 64, 512):
                a, b = per_call_ms(ours, x[:m]), per_call_ms(theirs, x[:m])
                row[f"M{m}"] = {"ours_ms": a, "torch_ms": b, "ratio": a / b}
            rows.append(row)
            times = "  ".join(f"M={m} {row[f'M{m}']['ratio']:.2f}x" for m in (1, 8, 64, 512))
            print(
                f"{row['shape']:>10} {row['dtype']:>8} ({ours.kernel:>6})  M with a varying row: torch "
                f"{row['torch_varying_M']:2d}/{len(ROW_COUNTS)}, ours {row['ours_varying_M']}  "
                f"| ours/torch time {times}",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
