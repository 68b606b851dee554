"""``make bench``: run the benchmark sweeps, plot them into docs/img/, and rewrite the
generated section of docs/benchmarks.md (between its ``bench:start`` / ``bench:end`` marks).

Sizes are modest on purpose (a few minutes on a 2-core CPU with the demo model):

    TTFT          prefix 256..4096 tokens + a 64-token question, cold vs warm, median of 3
                  (bench/ttft.py)

TTFT and cascade steps are timed in CPU seconds of one thread (torch at 1 thread,
``time.thread_time``): on a box whose cores other jobs share, wall time mostly measures
them. Burst times are wall-clock (the engine loop as a user sees it).
    burst         N = 4..64 requests over one 512-token prefix + 16 own tokens (bench/burst.py)
    cascade       decode batch 2..32 over a 2048-token shared prefix (bench/shared_decode.py)
    hit rate      40 system prompts of 1024 tokens, Zipf popularity, 2000 requests, pool
                  128..4096 blocks (bench/hit_rate.py)

    python bench/report.py                    # the documented sizes
    python bench/report.py --quick            # tiny sizes (a smoke run; writes to --out)
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from prefixcache.engine.model.progress import progress_bar, progress_iter

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

FULL = {
    "ttft_prefix": [256, 512, 1024, 2048, 4096],
    "ttft_suffix": 64,
    "burst_n": [4, 8, 16, 32, 64],
    "burst_prefix": 512,
    "burst_suffix": 16,
    "cascade_batch": [2, 4, 8, 16, 32],
    "cascade_prefix": 2048,
    "hit_pools": "128,256,512,1024,2048,4096",
    "hit_requests": 2000,
    "repeats": 3,  # TTFT: median of 3 cold/warm pairs; cascade: median of 5 steps
}
QUICK = {
    "ttft_prefix": [32, 64],
    "ttft_suffix": 8,
    "burst_n": [2, 4],
    "burst_prefix": 64,
    "burst_suffix": 8,
    "cascade_batch": [2, 4],
    "cascade_prefix": 128,
    "hit_pools": "16,64",
    "hit_requests": 50,
    "repeats": 1,
}


def bench_json(script: str, *args: str) -> dict:
    """Run one bench script with --json; its last line is the result."""
    cmd = [sys.executable, str(BENCH / script), *args, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[1:])} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ttft_sweep(sizes: dict) -> list[dict]:
    sys.path.insert(0, str(BENCH))
    import torch
    from ttft import measure  # bench/ttft.py: one cold and one warm request

    from prefixcache.engine.model.loader import load_model

    torch.set_num_threads(1)  # CPU time of this thread is then the whole work
    with progress_bar("load demo model", 1, leave=False) as bar:
        loaded = load_model("demo", dtype="float32", device="cpu")
        bar.update()
    rows = []
    repeats = sizes["repeats"]
    with progress_bar("TTFT cold vs warm", len(sizes["ttft_prefix"]) * repeats) as bar:
        for prefix in sizes["ttft_prefix"]:
            runs = []
            for k in range(repeats):
                parts = [prefix, sizes["ttft_suffix"]]
                rng = random.Random(prefix * 31 + k)
                runs.append(measure(loaded, parts, 2048, rng, time.thread_time))
                bar.update()
            row = dict(runs[0])  # the median cold and the median warm of the repeats
            row["cold_s"] = statistics.median(r["cold_s"] for r in runs)
            row["warm_s"] = statistics.median(r["warm_s"] for r in runs)
            row["speedup"] = round(row["cold_s"] / row["warm_s"], 2)
            row["efficiency"] = round(row["speedup"] / row["ideal_speedup"], 3)
            rows.append(row)
    return rows


def burst_sweep(sizes: dict) -> list[dict]:
    rows = []
    for n in progress_iter(sizes["burst_n"], "burst"):
        args = ["--n", str(n), "--prefix", str(sizes["burst_prefix"])]
        args += ["--suffix", str(sizes["burst_suffix"])]
        rows.append(bench_json("burst.py", *args))
    return rows


def cascade_sweep(sizes: dict) -> list[dict]:
    rows = []
    for batch in progress_iter(sizes["cascade_batch"], "cascade decode"):
        args = ["--batch", str(batch), "--prefix", str(sizes["cascade_prefix"])]
        repeat = str(sizes["repeats"] * 2 - 1)  # the median of this many timed steps
        args += ["--repeat", repeat, "--threads", "1", "--clock", "cpu", "--no-check"]
        rows.append(bench_json("shared_decode.py", *args))
    return rows


def hit_sweep(sizes: dict) -> dict:
    with progress_bar("hit rate vs pool size", 1) as bar:
        result = bench_json(
            "hit_rate.py", "--pools", sizes["hit_pools"], "--requests", str(sizes["hit_requests"])
        )
        bar.update()
    return result


# --- plots ------------------------------------------------------------------------------


def _log_x(ax: plt.Axes, values: list[int]) -> None:
    """A log2 x axis labelled at the measured values only."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(results: dict, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    names = []

    ttft = results["ttft"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = [r["cached"] for r in ttft]
    ax.plot(x, [r["cold_s"] * 1000 for r in ttft], "o-", label="cold (empty cache)")
    ax.plot(x, [r["warm_s"] * 1000 for r in ttft], "o-", label="warm (prefix cached)")
    ax.set(yscale="log", xlabel="prefix tokens", ylabel="TTFT (CPU ms, 1 thread)")
    _log_x(ax, x)
    ax.set_title(f"Time to first token, prefix + {results['sizes']['ttft_suffix']}-token question")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, out / "bench_ttft.png")
    names.append("bench_ttft.png")

    burst = results["burst"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    n = [r["n"] for r in burst]
    a1.plot(n, [r["cached_all_first_token_s"] for r in burst], "o-")
    a1.set(xlabel="concurrent requests N", ylabel="all first tokens (s)")
    a1.set_title("Burst over one shared prefix")
    a2.plot(n, [r["peak_blocks"] for r in burst], "o-", label="peak blocks")
    a2.plot(n, [r["ideal_blocks"] for r in burst], "--", label="ideal (all resident)")
    a2.set(xlabel="concurrent requests N", ylabel="KV blocks")
    a2.legend()
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
        _log_x(a, n)
    _save(fig, out / "bench_burst.png")
    names.append("bench_burst.png")

    cascade = results["cascade"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    b = [r["batch"] for r in cascade]
    ax.plot(b, [r["step_s_no_cascade"] * 1000 for r in cascade], "o-", label="plain attention")
    ax.plot(b, [r["step_s_cascade"] * 1000 for r in cascade], "o-", label="cascade")
    ax.set(xlabel="decode batch", ylabel="decode step (CPU ms, 1 thread)")
    _log_x(ax, b)
    ax.set_title(f"Shared-prefix decode, {results['sizes']['cascade_prefix']}-token prefix")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, out / "bench_cascade.png")
    names.append("bench_cascade.png")

    hit = results["hit_rate"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    pools = [r["pool_blocks"] for r in hit["rows"]]
    ax.plot(pools, [r["hit_rate"] for r in hit["rows"]], "o-", label="LRU, leaves first")
    ax.axhline(hit["ideal_hit_rate"], ls="--", color="grey", label="unbounded pool")
    ax.axvline(hit["working_set_blocks"], ls=":", color="grey", label="system prompts' blocks")
    ax.set(xlabel="KV pool (blocks of 16 tokens)", ylabel="token hit rate")
    _log_x(ax, pools)
    ax.set_ylim(0, 1)
    ax.set_title(f"Hit rate vs pool size ({hit['prompts']} prompts, Zipf)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    _save(fig, out / "bench_hit_rate.png")
    names.append("bench_hit_rate.png")
    return names


# --- the markdown section ----------------------------------------------------------------


def markdown(results: dict, img: str) -> str:
    s = results["sizes"]
    lines = [
        START,
        "<!-- generated by `make bench` (bench/report.py); edit the script, not this part -->",
        f"Run on {results['date']}, {results['seconds']:.0f} s in all (demo model, fp32, CPU). "
        "TTFT and decode steps in CPU ms of one thread (torch at 1 thread); burst in wall "
        "seconds.",
        "",
        f"### TTFT against prefix length (+ a {s['ttft_suffix']}-token question)",
        "",
        f"![TTFT cold vs warm]({img}/bench_ttft.png)",
        "",
        "| prefix tokens | cold (CPU ms) | warm (CPU ms) | speedup | FLOP ideal |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results["ttft"]:
        lines.append(
            f"| {r['cached']} | {r['cold_s'] * 1000:.1f} | {r['warm_s'] * 1000:.1f} | "
            f"{r['speedup']}× | {r['ideal_speedup']}× |"
        )
    lines += [
        "",
        f"### Burst: N requests over one {s['burst_prefix']}-token prefix "
        f"(+ {s['burst_suffix']} own tokens)",
        "",
        f"![burst time and blocks]({img}/bench_burst.png)",
        "",
        "| N | prompt tokens computed | ideal | peak blocks | ideal blocks | all first tokens (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["burst"]:
        lines.append(
            f"| {r['n']} | {r['prompt_tokens_computed']} | {r['ideal_tokens']} | "
            f"{r['peak_blocks']} | {r['ideal_blocks']} | {r['cached_all_first_token_s']:.3f} |"
        )
    lines += [
        "",
        f"### Cascade decode against batch ({s['cascade_prefix']}-token shared prefix)",
        "",
        f"![cascade decode]({img}/bench_cascade.png)",
        "",
        "| batch | plain step (CPU ms) | cascade step (CPU ms) | speedup | attention speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results["cascade"]:
        lines.append(
            f"| {r['batch']} | {r['step_s_no_cascade'] * 1000:.1f} | "
            f"{r['step_s_cascade'] * 1000:.1f} | {r['speedup']}× | {r['attention_speedup']}× |"
        )
    hit = results["hit_rate"]
    lines += [
        "",
        f"### Hit rate against pool size ({hit['prompts']} system prompts of {hit['prefix']} "
        f"tokens, Zipf(1.1), {hit['requests']} requests)",
        "",
        f"![hit rate vs pool]({img}/bench_hit_rate.png)",
        "",
        "| pool (blocks) | token hit rate | blocks evicted |",
        "|---:|---:|---:|",
    ]
    for r in hit["rows"]:
        lines.append(f"| {r['pool_blocks']} | {r['hit_rate']:.3f} | {r['evicted_blocks']} |")
    lines += [
        f"| unbounded | {hit['ideal_hit_rate']:.3f} | 0 |",
        "",
        END,
    ]
    return "\n".join(lines)


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text(encoding="utf-8")
    if START in text and END in text:
        text = re.sub(
            re.escape(START) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S
        )
    else:
        text = text.rstrip("\n") + "\n\n## Sweeps (`make bench`)\n\n" + section + "\n"
    doc.write_text(text, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-doc", action="store_true", help="plots only, leave the doc alone")
    ap.add_argument("--replot", action="store_true", help="redraw from OUT/bench_results.json")
    args = ap.parse_args()
    saved = args.out / "bench_results.json"
    if args.replot:
        results = json.loads(saved.read_text())
    else:
        sizes = QUICK if args.quick else FULL
        began = time.monotonic()
        results = {
            "sizes": sizes,
            "ttft": ttft_sweep(sizes),
            "burst": burst_sweep(sizes),
            "cascade": cascade_sweep(sizes),
            "hit_rate": hit_sweep(sizes),
        }
        results["seconds"] = time.monotonic() - began
        results["date"] = time.strftime("%Y-%m-%d")
    names = plot_all(results, args.out)
    saved.write_text(json.dumps(results, indent=1))
    if not args.no_doc:
        try:
            img = args.out.resolve().relative_to(args.doc.resolve().parent).as_posix()
        except ValueError:
            img = args.out.resolve().as_posix()
        write_section(args.doc, markdown(results, img))
    print(f"wrote {', '.join(names)} to {args.out}" + ("" if args.no_doc else f"; {args.doc}"))


if __name__ == "__main__":
    main()
