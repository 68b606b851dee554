"""KV tiers: evicted prefixes reloaded from host memory or disk instead of recomputed.

    .venv/bin/python bench/tiers.py [--json] [--quick] [--plot docs/tiers.png]

1. Working set larger than the pool: ``--docs`` documents of ``--doc-tokens`` tokens, a pool
   that holds ``--pool-docs`` of them, requests drawn Zipf-like (s = ``--zipf``) over the docs,
   each the doc plus a unique question; one request at a time. Token hit rate and TTFT p50/p90
   with no tier, a host tier and a disk tier big enough for the working set, against an
   unbounded pool; and write-all vs write-after-hit spilling (host tier). The sweep over
   working-set sizes (docs / pool) feeds the plot.
2. One long prefix (``--long`` tokens): TTFT computed cold vs reloaded from the disk tier and
   the host tier (the pool forgot it, the tier kept it); the first tokens' logprobs compared.
3. No hits at all (every prompt unique, the pool always full): TTFT with and without a tier
   (every eviction is a spill), interleaved runs, medians.
4. Reload throughput: ``KVTier.reload`` timed alone (host tier, and disk tier from the page
   cache) for ``--reload-blocks`` blocks of the demo model's KV, bytes per second, medians of
   ``--reload-repeats``; a plain memory copy of the same bytes for scale.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from tier_reload import reload_over_pool_hit, reload_throughput

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import EngineRequest, SamplingParams

BS = 16
QUESTION = 16  # tokens of each request's own question


@dataclass(slots=True)
class Run:
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    reloaded_tokens: int
    tier_writes: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_engine(loaded: LoadedModel, num_blocks: int, tier: str | None, policy: str = "all"):
    config = EngineConfig(
        model="demo",
        dtype="float32",
        device="cpu",
        num_blocks=num_blocks,
        max_num_batched_tokens=4096,
        kv_offload=tier,
        kv_spill_policy=policy,
    )
    return LLMEngine(config, loaded)


def first_token(engine: LLMEngine, prompt: list[int], logprobs: int | None = None):
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=logprobs)
    start = time.perf_counter()
    (result,) = engine.generate([EngineRequest(f"q{time.perf_counter_ns()}", prompt, sampling)])
    return time.perf_counter() - start, result


def zipf_workload(
    rng: random.Random, vocab: int, docs: int, doc_tokens: int, requests: int, s: float
) -> list[list[int]]:
    texts = [[rng.randrange(3, vocab) for _ in range(doc_tokens)] for _ in range(docs)]
    weights = [1 / (k + 1) ** s for k in range(docs)]
    rng.shuffle(texts)  # popularity is not creation order
    picks = rng.choices(range(docs), weights, k=requests)
    return [texts[d] + [rng.randrange(3, vocab) for _ in range(QUESTION)] for d in picks]


def run_workload(engine: LLMEngine, prompts: list[list[int]], desc: str) -> Run:
    ttfts, cached, total = [], 0, 0
    for prompt in progress_iter(prompts, desc):
        seconds, result = first_token(engine, prompt)
        ttfts.append(seconds)
        cached += result.usage.cached_tokens
        total += len(prompt)
    tier = engine.tier_stats()
    engine.close()
    return Run(
        cached / total,
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.9),
        engine.block_manager.stats().reloaded_tokens,
        tier.writes if tier is not None else 0,
    )


def tier_arg(kind: str, gib: float, directory: str) -> str | None:
    if kind == "none":
        return None
    return f"host:{gib}" if kind == "host" else f"disk:{directory}:{gib}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=128)
    parser.add_argument("--pool-docs", type=int, default=8, help="docs the pool holds")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--sweep", default="0.5,1,2,4", help="working set / pool, for the plot")
    parser.add_argument("--long", type=int, default=20000, help="tokens of the reload prefix")
    parser.add_argument("--miss-prompts", type=int, default=6)
    parser.add_argument("--miss-tokens", type=int, default=512)
    parser.add_argument("--reload-blocks", default="63,1250", help="blocks per reload (part 4)")
    parser.add_argument("--reload-repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run")
    parser.add_argument("--plot", default=None, help="write the sweep's plot (PNG) here")
    parser.add_argument("--plot-from", default=None, help="plot the sweep of a saved --json line")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.doc_tokens, args.pool_docs, args.requests = 8, 64, 2, 16
        args.sweep, args.long, args.miss_prompts, args.miss_tokens = "1,4", 512, 2, 128
        args.reload_blocks, args.reload_repeats = "63", 3

    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.loads(f.read().strip().splitlines()[-1])["sweep"], args.plot or "tiers.png")
        return
    parts = {int(p) for p in args.parts.split(",")}
    loaded = load_model("demo", dtype="float32", device="cpu")
    vocab = loaded.config.vocab_size
    block_bytes = loaded.kv_cache_spec(BS).bytes_per_block
    doc_blocks = (args.doc_tokens + QUESTION) // BS + 1
    pool_blocks = args.pool_docs * doc_blocks + 8
    out: dict = {"bench": "tiers", "doc_tokens": args.doc_tokens, "pool_blocks": pool_blocks}
    tmp = tempfile.TemporaryDirectory(prefix="prefixcache-bench-")

    sweep: dict[str, dict[str, dict]] = {}
    if 1 in parts:
        # 1. Zipf over a working set larger than the pool
        def tier_gib(docs: int) -> float:  # big enough for the whole working set
            return round(docs * doc_blocks * block_bytes * 1.25 / 1024**3, 4) + 0.001

        for ratio in [float(r) for r in args.sweep.split(",")]:
            docs = max(1, round(args.pool_docs * ratio))
            prompts = zipf_workload(
                random.Random(1), vocab, docs, args.doc_tokens, args.requests, args.zipf
            )
            row: dict[str, dict] = {}
            unbounded = make_engine(loaded, docs * doc_blocks + args.requests + 64, None)
            label = f"working set {ratio:g}x pool"
            row["unbounded"] = asdict(run_workload(unbounded, prompts, f"{label}, unbounded"))
            for kind in ("none", "host", "disk"):
                engine = make_engine(loaded, pool_blocks, tier_arg(kind, tier_gib(docs), tmp.name))
                row[kind] = asdict(run_workload(engine, prompts, f"{label}, tier {kind}"))
            sweep[f"{ratio:g}"] = row
            print(
                f"working set {ratio:g}x pool: "
                + ", ".join(
                    f"{k} hit {v['hit_rate']:.3f} p90 {v['ttft_p90'] * 1e3:.0f} ms"
                    for k, v in row.items()
                )
            )
        out["sweep"] = sweep
        big = sweep[max(sweep, key=float)]
        out["hit_rate_vs_unbounded"] = {
            kind: big[kind]["hit_rate"] / big["unbounded"]["hit_rate"]
            for kind in ("none", "host", "disk")
        }

        # write-all vs write-after-hit, at the largest working set, host tier
        docs = max(1, round(args.pool_docs * max(float(r) for r in args.sweep.split(","))))
        prompts = zipf_workload(
            random.Random(1), vocab, docs, args.doc_tokens, args.requests, args.zipf
        )
        policies = {}
        for policy in ("all", "hit"):
            engine = make_engine(loaded, pool_blocks, tier_arg("host", tier_gib(docs), ""), policy)
            policies[policy] = asdict(run_workload(engine, prompts, f"spill policy {policy}"))
        out["spill_policy"] = policies
        print(
            "spill policy: "
            + ", ".join(
                f"{k} hit {v['hit_rate']:.3f} writes {v['tier_writes']}"
                for k, v in policies.items()
            )
        )

    if 2 in parts:
        # 2. one long prefix: cold vs reloaded
        rng = random.Random(2)
        prefix = [rng.randrange(3, vocab) for _ in range(args.long)]
        prompt = prefix + [rng.randrange(3, vocab) for _ in range(QUESTION)]
        long_blocks = len(prompt) // BS + 16
        gib = round(long_blocks * block_bytes * 1.1 / 1024**3, 4) + 0.001
        reload: dict[str, float] = {}
        logprobs: dict[str, list[float]] = {}
        disk = make_engine(loaded, long_blocks, tier_arg("disk", gib, tmp.name))
        reload["cold"], cold = first_token(disk, prompt, logprobs=5)
        logprobs["cold"] = [lp for _, lp in cold.logprobs[0].top]
        # the host engine gets the same KV without a second 20K prefill: the pinned-prefix
        # snapshot (the /v1/cache/save path), restored, unpinned
        host = make_engine(loaded, long_blocks, tier_arg("host", gib, tmp.name))
        disk.pin(prefix, "")
        host.restore_pinned(disk.snapshot_pinned())
        disk.unpin(prefix, "")
        host.unpin(prefix, "")
        for kind, engine in (("disk", disk), ("host", host)):
            engine.evict_all(keep_tier=True)
            warm_s, warm = first_token(engine, prompt, logprobs=5)
            assert warm.usage.cached_tokens >= args.long // BS * BS - BS, warm.usage
            assert warm.usage.cached_tokens_by_tier.get(kind, 0) >= warm.usage.cached_tokens - BS
            reload[kind] = warm_s
            logprobs[kind] = [lp for _, lp in warm.logprobs[0].top]
            engine.close()
        out["long_prefix"] = {
            "tokens": args.long,
            "ttft_cold_s": reload["cold"],
            "ttft_disk_s": reload["disk"],
            "ttft_host_s": reload["host"],
            "speedup_disk": reload["cold"] / reload["disk"],
            "speedup_host": reload["cold"] / reload["host"],
            "max_logprob_diff": max(
                abs(a - b)
                for kind in ("disk", "host")
                for a, b in zip(logprobs["cold"], logprobs[kind], strict=True)
            ),
        }
        print(
            f"long prefix {args.long}: cold {reload['cold']:.2f} s, disk {reload['disk']:.3f} s, "
            f"host {reload['host']:.3f} s"
        )

    if 3 in parts:
        # 3. no hits: the tier's cost when nothing comes back
        miss_blocks = 2 * (args.miss_tokens // BS + 2)  # two prompts: every admission evicts
        times: dict[str, list[float]] = {"none": [], "host": [], "disk": []}
        engines = {
            kind: make_engine(loaded, miss_blocks, tier_arg(kind, 0.05, tmp.name)) for kind in times
        }
        spill_seconds = {"host": 0.0, "disk": 0.0}
        for kind in spill_seconds:
            tier = engines[kind].tier
            assert tier is not None
            tier.spill = timed(tier.spill, spill_seconds, kind)  # type: ignore[method-assign]
        rng = random.Random(3)
        for _ in progress_iter(range(args.miss_prompts + 1), "no hits: prompts"):
            unique = [rng.randrange(3, vocab) for _ in range(args.miss_tokens)]
            for kind, engine in engines.items():
                seconds, result = first_token(engine, unique)
                assert result.usage.cached_tokens == 0
                times[kind].append(seconds)
        for engine in engines.values():
            engine.close()
        medians = {
            kind: statistics.median(t[1:]) for kind, t in times.items()
        }  # the first warms up
        # the tier's own cost on the engine thread (copying evicted pages out), timed directly:
        # robust where TTFTs on a shared box swing by more than the effect
        spill_share = {kind: spill_seconds[kind] / sum(times[kind]) for kind in ("host", "disk")}
        out["no_hits"] = {
            "prompt_tokens": args.miss_tokens,
            "ttft_median_s": medians,
            "extra_host": medians["host"] / medians["none"] - 1,
            "extra_disk": medians["disk"] / medians["none"] - 1,
            "spill_share_of_ttft": spill_share,
        }
        print(
            f"no hits: extra TTFT host {out['no_hits']['extra_host']:+.2%}, "
            f"disk {out['no_hits']['extra_disk']:+.2%}; engine-thread spill time "
            f"host {spill_share['host']:.3%}, disk {spill_share['disk']:.3%} of TTFT"
        )
    if 4 in parts:
        sizes = [int(n) for n in args.reload_blocks.split(",")]
        out["reload"] = reload_throughput(
            loaded.kv_cache_spec(BS), sizes, args.reload_repeats, tmp.name
        )
        out["reload"]["engine_1008_tokens"] = reload_over_pool_hit(
            loaded,
            args.reload_repeats,
            tmp.name,
            lambda kind, gib: make_engine(loaded, 256, tier_arg(kind, gib, tmp.name)),
            first_token,
        )
    tmp.cleanup()

    if args.plot and sweep:
        plot(sweep, args.plot)
    if args.json:
        print(json.dumps(out))


def timed(fn, totals: dict[str, float], key: str):
    def wrapper(*args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


def plot(sweep: dict[str, dict[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted(sweep, key=float)
    xs = [float(r) for r in ratios]
    fig, (hit, p90) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in (("unbounded", "k--"), ("none", "o-"), ("host", "s-"), ("disk", "^-")):
        hit.plot(xs, [sweep[r][kind]["hit_rate"] for r in ratios], style, label=kind)
        p90.plot(xs, [sweep[r][kind]["ttft_p90"] * 1e3 for r in ratios], style, label=kind)
    hit.set(xlabel="working set / pool", ylabel="token hit rate", ylim=(0, 1))
    p90.set(xlabel="working set / pool", ylabel="TTFT p90 (ms)")
    for ax in (hit, p90):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("KV tiers: Zipf requests over a working set larger than the pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
