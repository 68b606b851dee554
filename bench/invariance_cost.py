"""What batch invariance costs: ``bench/serving.py``'s workloads with it on (the default) and
off (``--no-batch-invariance``), the two servers started in turn on the same checkpoint.
``--baseline kernels-off`` makes the second server ``PREFIXCACHE_CPU_KERNELS=0`` instead
(torch's ops throughout, not batch-invariant): what the engine's C++ kernels cost or save
on this CPU, e.g. their AVX2 build.

Workloads: ``shared`` (8 groups x 8 requests, 1,024-token system prompt, 64-token question,
32 out, 16 in flight), ``decode`` (4 x 8, 128 out, 32 in flight) and ``ttft`` (4,000-token
prompt, cold and warm with 3,900 cached; medians of ``--repeat``). Each pair runs on then off,
``--rounds`` times; the medians and the on/off ratios are printed (tok/s: on/off above 1 is
faster; latencies: on/off below 1 is faster).

    .venv/bin/python bench/make_bench_model.py --out /tmp/bench-llama55m
    .venv/bin/python bench/invariance_cost.py --model /tmp/bench-llama55m [--rounds 2] [--json]
        [--baseline no-batch-invariance|kernels-off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from prefixcache.engine.kernels.cpu_features import cpu_flags

SERVING = Path(__file__).with_name("serving.py")
WORKLOADS = {
    "shared": ["--workload", "shared", "--groups", "8", "--per-group", "8", "--system", "1024",
               "--question", "64", "--output", "32", "--concurrency", "16"],
    "decode": ["--workload", "shared", "--groups", "4", "--per-group", "8", "--system", "1024",
               "--question", "64", "--output", "128", "--concurrency", "32"],
    "ttft": ["--workload", "ttft", "--prompt", "4000", "--shared", "3900"],
}  # fmt: skip
FIGURES = {
    "shared": ("output_tok_s", "ttft_p50_ms", "itl_mean_ms"),
    "decode": ("output_tok_s", "ttft_p50_ms", "itl_mean_ms"),
    "ttft": ("A_cold_ms", "B_warm_ms"),
}


BASELINES = ("no-batch-invariance", "kernels-off")


def run(model: str, workload: str, invariant: bool, repeat: int, baseline: str) -> dict:
    cmd = [sys.executable, str(SERVING), "--serve", model, *WORKLOADS[workload], "--json"]
    if workload == "ttft":
        cmd += ["--repeat", str(repeat)]
    env = dict(os.environ)
    if not invariant and baseline == "kernels-off":
        env["PREFIXCACHE_CPU_KERNELS"] = "0"
    elif not invariant:
        cmd += ["--", "--no-batch-invariance"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def pick(result: dict, key: str) -> float:
    """A figure from serving.py's JSON, found by name at any depth."""
    stack = [result]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if key in node and isinstance(node[key], int | float):
                return float(node[key])
            stack.extend(node.values())
    raise KeyError(f"{key} not in serving.py's output: {sorted(result)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="ttft rounds inside each run")
    ap.add_argument("--workloads", default="shared,decode,ttft")
    ap.add_argument("--baseline", choices=BASELINES, default=BASELINES[0], help="the 'off' server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    flags = cpu_flags()
    cpu = "AVX512_BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    print(f"CPU features: {cpu}; off = {args.baseline}", flush=True)
    report: dict[str, dict] = {}
    for workload in args.workloads.split(","):
        samples: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.rounds):
            for invariant in (True, False):
                samples[invariant].append(
                    run(args.model, workload, invariant, args.repeat, args.baseline)
                )
        rows = {}
        for key in FIGURES[workload]:
            on = statistics.median(pick(r, key) for r in samples[True])
            off = statistics.median(pick(r, key) for r in samples[False])
            rows[key] = {"on": on, "off": off, "on_over_off": on / off}
            print(f"{workload:7s} {key:14s} on {on:9.1f}  off {off:9.1f}  on/off {on / off:.3f}")
        report[workload] = rows
    if args.json:
        print(
            json.dumps(
                {"cpu": cpu, "baseline": args.baseline, "rounds": args.rounds, "results": report}
            )
        )


if __name__ == "__main__":
    main()
