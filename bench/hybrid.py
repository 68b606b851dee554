"""Prefix caching on a hybrid model: Gemma 3 270M (5 sliding-window layers to 1 global).

Four figures, through the whole engine (scheduler, chunked prefill, paged pools):

- ``shared``: a 2K-token prefix served to 16 requests, each with its own 64-token suffix
  (``--suffix``): hit rate, TTFT cold vs warm (medians of ``--cold-runs`` cold requests over
  their own prefixes, 3, and of the 15 warm ones), and the warm
  speedup against the ideal one (the FLOP ratio, window-aware: bench/flops.py); the LM head's
  time in the warm requests (one row reads the whole tied 262K x 640 head) and the efficiency
  it alone allows.
- ``lengths``: a hit at every prompt length above one page: for each length L, a request
  over L shared tokens after one that cached them; the cached tokens it reports, against all
  the first request's full blocks could give (only full blocks are stored).
- ``held``: KV bytes a running request holds at 4K context, against the same model with every
  layer global (the layout an engine without hybrid caching keeps).
- ``capacity``: in a fixed KV budget, how many distinct 1K-token prefixes still give a full
  hit when asked again (newest first), hybrid against all-global.
- ``tier``: the shared prefix evicted into a host KV tier (``--kv-offload``) before each
  request: TTFT reloaded against computed (cold) and against a pool hit, and the KV bytes a
  reload copies (the global layers' pages, the sliding layers' last window) against what the
  all-global layout would copy.

    .venv/bin/python bench/hybrid.py [--model gemma3] [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch
from flops import prefill_flops

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.request import EngineRequest, SamplingParams

BLOCK = 16
MIB = 1 << 20


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the request reports cached."""
    start = time.perf_counter()
    (out,) = engine.generate([EngineRequest(rid, prompt, SamplingParams(max_tokens=1))])
    return time.perf_counter() - start, out.usage.cached_tokens


def config(loaded: LoadedModel, **kw: object) -> EngineConfig:
    return EngineConfig(
        model=loaded.name, dtype=str(loaded.dtype).removeprefix("torch."), device="cpu", **kw
    )


def all_global(loaded: LoadedModel) -> LoadedModel:
    """The same weights with every layer's KV kept whole (what an engine without hybrid
    caching holds); used for memory figures only."""
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, layer_windows=()))


def timing_head(engine: LLMEngine, seconds: list[float]) -> None:
    """Time every LM head call (``compute_logits``) of ``engine``'s model into ``seconds``."""
    model = engine.runner.model
    compute_logits = model.compute_logits

    def timed(hidden: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        logits = compute_logits(hidden)
        seconds.append(time.perf_counter() - start)
        return logits

    model.compute_logits = timed  # an instance attribute: this engine's model only


def shared(
    loaded: LoadedModel,
    rng: random.Random,
    prefix_len: int,
    n: int,
    suffix_len: int,
    cold_runs: int = 3,
) -> dict:
    vocab = loaded.config.vocab_size
    engine = LLMEngine(config(loaded, num_blocks=4096, max_num_batched_tokens=2048), loaded)
    ttft(engine, "warmup", tokens(rng, 96, vocab))  # first-call costs
    engine.evict_all()
    prefix = tokens(rng, prefix_len, vocab)
    suffixes = [tokens(rng, suffix_len, vocab) for _ in range(n)]
    # Cold is the median of `cold_runs` requests, each over its own prefix, the shared one
    # last: one request's TTFT moves with the box's moment as much as the warm median does.
    colds = [ttft(engine, f"c{i}", tokens(rng, prefix_len + suffix_len, vocab))[0]
             for i in range(cold_runs - 1)]  # fmt: skip
    colds.append(ttft(engine, "r0", prefix + suffixes[0])[0])
    cold = statistics.median(colds)
    head: list[float] = []
    timing_head(engine, head)
    warm, cached = [], []
    for i, s in enumerate(suffixes[1:], 1):
        t, c = ttft(engine, f"r{i}", prefix + s)
        warm.append(t)
        cached.append(c)
    del engine.runner.model.compute_logits
    total = prefix_len + suffix_len
    ideal = prefill_flops(loaded.config, 0, total) / prefill_flops(
        loaded.config, prefix_len, suffix_len
    )
    speedup = cold / statistics.median(warm)
    # The LM head reads its whole weight for one row, cold and warm alike (memory-bound, not
    # counted by the FLOP ideal): the efficiency if everything else scaled ideally.
    head_s = statistics.median(head)
    ceiling = cold / ((cold - head_s) / ideal + head_s) / ideal
    return {
        "requests": n,
        "prefix": prefix_len,
        "suffix": suffix_len,
        "hit_rate": round(sum(cached) / ((n - 1) * total), 4),
        "ideal_hit_rate": round(prefix_len / total, 4),
        "cold_ttft_ms": round(cold * 1e3, 1),
        "cold_ttft_runs_ms": [round(c * 1e3, 1) for c in colds],
        "warm_ttft_p50_ms": round(statistics.median(warm) * 1e3, 1),
        "speedup": round(speedup, 2),
        "ideal_speedup": round(ideal, 2),
        "efficiency": round(speedup / ideal, 3),
        "warm_head_p50_ms": round(head_s * 1e3, 1),
        "efficiency_ceiling_with_head": round(ceiling, 3),
    }


# Prompt lengths of the hit sweep: around one page, the 512-token window and past it.
LENGTHS = [17, 31, 100, 257, 511, 513, 600, 1000, 2047, 3000]


def lengths(loaded: LoadedModel, rng: random.Random, sizes: list[int]) -> dict:
    vocab = loaded.config.vocab_size
    engine = LLMEngine(config(loaded, num_blocks=2048), loaded)
    rows = []
    for n in sizes:
        prefix = tokens(rng, n, vocab)
        ttft(engine, f"a{n}", prefix + tokens(rng, 8, vocab))
        _, cached = ttft(engine, f"b{n}", prefix + tokens(rng, 8, vocab))
        # Only full blocks are stored: the first request's (n + 8 tokens) full blocks, of which
        # the second shares its first n tokens (a partial last block is copied on write).
        possible = min(n, (n + 8) // BLOCK * BLOCK)
        rows.append({"length": n, "cached": cached, "possible": possible})
    return {
        "rows": rows,
        "hit_at_every_length": all(r["cached"] >= r["possible"] for r in rows),
        "min_fraction": round(min(r["cached"] / r["possible"] for r in rows), 3),
    }


def held(loaded: LoadedModel, rng: random.Random, context: int) -> dict:
    """KV bytes a running request holds at ``context`` tokens, hybrid vs all-global."""
    c = loaded.config
    vocab = c.vocab_size
    engine = LLMEngine(config(loaded, num_blocks=2 * context // BLOCK + 64), loaded)
    prompt = tokens(rng, context - 8, vocab)
    engine.add_request(EngineRequest("long", prompt, SamplingParams(max_tokens=16)))
    while engine.num_running == 0 or engine.block_manager.stats().num_local_held == 0:
        engine.step()
    for _ in range(8):  # decoding at about ``context`` tokens
        engine.step()
    stats = engine.block_manager.stats()
    page = engine.kv_cache.spec.bytes_per_layer_page
    num_local = len(engine.kv_cache.local_layers)
    held_blocks = stats.num_used_blocks
    hybrid = (
        held_blocks * (c.num_layers - num_local) * page + stats.num_local_held * num_local * page
    )
    full = -(-context // BLOCK) * c.num_layers * page
    while engine.has_unfinished:
        engine.step()
    return {
        "context": context,
        "global_blocks_held": held_blocks,
        "local_pages_held": stats.num_local_held,
        "hybrid_mib": round(hybrid / MIB, 2),
        "all_global_mib": round(full / MIB, 2),
        "ratio": round(hybrid / full, 3),
    }


def capacity(loaded: LoadedModel, rng: random.Random, budget_mib: int, prefix_len: int) -> dict:
    """Distinct prefixes that still hit in full after many were cached, in one KV budget."""
    vocab = loaded.config.vocab_size
    result = {}
    prefixes = None
    for name, model in (("hybrid", loaded), ("all_global", all_global(loaded))):
        engine = LLMEngine(
            config(
                model,
                kv_memory_bytes=budget_mib * MIB,
                max_num_seqs=4,  # the local pool's floor: 4 windows and one 512-token step
                max_num_batched_tokens=512,
            ),
            model,
        )
        pool_tokens = engine.block_manager.num_blocks * BLOCK
        if prefixes is None:  # enough to overflow the larger pool, the same for both
            count = 2 * pool_tokens // prefix_len + 4
            prefixes = [tokens(rng, prefix_len, vocab) for _ in range(count)]
        for i, p in enumerate(prefixes):
            ttft(engine, f"p{i}", p)
        full = 0
        for p in reversed(prefixes):  # newest first, read-only matches
            m = engine.block_manager.match(p, "", len(p) - 1)
            if m.num_tokens < (len(p) - 1) // BLOCK * BLOCK:
                break
            full += 1
        result[name] = {"global_pages": engine.block_manager.num_blocks, "prefixes_hit": full}
    result["ratio"] = round(
        result["hybrid"]["prefixes_hit"] / result["all_global"]["prefixes_hit"], 2
    )
    return result


def tier(loaded: LoadedModel, rng: random.Random, prefix_len: int, n: int) -> dict:
    """A shared prefix reloaded from a host tier before every request, against cold and pool."""
    vocab = loaded.config.vocab_size
    kw = {"num_blocks": 4096, "max_num_batched_tokens": 2048, "kv_offload": "host:1"}
    engine = LLMEngine(config(loaded, **kw), loaded)
    try:
        ttft(engine, "warmup", tokens(rng, 96, vocab))
        engine.evict_all()
        prefix = tokens(rng, prefix_len, vocab)
        cold, _ = ttft(engine, "c", prefix + tokens(rng, 64, vocab))
        pool, reloaded, cached = [], [], []
        for i in range(n):
            t, _ = ttft(engine, f"p{i}", prefix + tokens(rng, 64, vocab))
            pool.append(t)
            engine.evict_all(keep_tier=True)  # the pool emptied into the tier
            t, c = ttft(engine, f"r{i}", prefix + tokens(rng, 64, vocab))
            reloaded.append(t)
            cached.append(c)
        manager, cache = engine.block_manager, engine.kv_cache
        assert manager.tier is not None and manager.local_tier is not None
        g, loc = manager.tier.stats(), manager.local_tier.stats()  # what the reloads copied
        copied = (g.reloads * g.slot_bytes + loc.reloads * loc.slot_bytes) / n
        blocks = prefix_len // BLOCK
        full = blocks * (cache.global_io.bytes_per_block + cache.local_io.bytes_per_block)
        stats = manager.stats()
    finally:
        engine.close()
    r, w = statistics.median(reloaded), statistics.median(pool)
    return {
        "prefix": prefix_len,
        "requests": n,
        "cached_tokens_min": min(cached),
        "reloaded_tokens": stats.reloaded_tokens,
        "cold_ttft_ms": round(cold * 1e3, 1),
        "pool_ttft_p50_ms": round(w * 1e3, 1),
        "reloaded_ttft_p50_ms": round(r * 1e3, 1),
        "reloaded_vs_cold": round(cold / r, 2),
        "reloaded_vs_pool": round(r / w, 3),
        "local_pages_refilled": loc.reloads // n,
        "copied_mib": round(copied / MIB, 2),
        "all_global_mib": round(full / MIB, 2),
        "copied_ratio": round(copied / full, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument(
        "--cold-runs", type=int, default=3, help="cold requests (distinct prefixes), median"
    )
    parser.add_argument("--suffix", type=int, default=64, help="tokens after the shared prefix")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--capacity-prefix", type=int, default=1024)
    parser.add_argument("--tier-requests", type=int, default=8)
    parser.add_argument(
        "--max-length", type=int, default=LENGTHS[-1], help="longest prompt of the hit sweep"
    )
    parser.add_argument(
        "--gguf-weights",
        choices=["auto", "quantized", "dequantized"],
        default="dequantized",
        help="as `prefixcache serve --gguf-weights` (model/gguf_weights.py)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", gguf_weights=args.gguf_weights)
    if not loaded.config.is_hybrid:
        raise SystemExit(f"{args.model} has no sliding-window layers")
    rng = random.Random(0)
    figures = {
        "cpu": cpu_model_name(),
        "model": args.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "gguf_weights": args.gguf_weights,
        "windows": sorted(set(loaded.config.layer_windows)),
        "shared": shared(loaded, rng, args.prefix, args.requests, args.suffix, args.cold_runs),
        "lengths": lengths(loaded, rng, [n for n in LENGTHS if n <= args.max_length]),
        "held": held(loaded, rng, args.context),
        "capacity": capacity(loaded, rng, args.budget_mib, args.capacity_prefix),
        "tier": tier(loaded, rng, args.prefix, args.tier_requests),
    }
    s, h, c, t = figures["shared"], figures["held"], figures["capacity"], figures["tier"]
    print(
        f"shared {s['prefix']}-token prefix x {s['requests']} (+{s['suffix']}): hit rate {s['hit_rate']} "
        f"(ideal {s['ideal_hit_rate']}), TTFT cold {s['cold_ttft_ms']} ms "
        f"(median of {len(s['cold_ttft_runs_ms'])}), warm p50 "
        f"{s['warm_ttft_p50_ms']} ms: {s['speedup']}x of ideal {s['ideal_speedup']}x "
        f"(efficiency {s['efficiency']}); LM head {s['warm_head_p50_ms']} ms a warm request: "
        f"efficiency at most {s['efficiency_ceiling_with_head']} with it"
    )
    print(
        f"hits at every length: {figures['lengths']['hit_at_every_length']} "
        f"(min cached fraction {figures['lengths']['min_fraction']})"
    )
    print(
        f"held at {h['context']} tokens: {h['hybrid_mib']} MiB vs all-global "
        f"{h['all_global_mib']} MiB = {h['ratio']}x"
    )
    print(
        f"{args.budget_mib} MiB KV, {args.capacity_prefix}-token prefixes still hit: hybrid "
        f"{c['hybrid']['prefixes_hit']}, all-global {c['all_global']['prefixes_hit']} = {c['ratio']}x"
    )
    print(
        f"from the tier: TTFT {t['reloaded_ttft_p50_ms']} ms against cold {t['cold_ttft_ms']} ms "
        f"({t['reloaded_vs_cold']}x) and a pool hit {t['pool_ttft_p50_ms']} ms "
        f"({t['reloaded_vs_pool']}x); {t['copied_mib']} MiB copied against "
        f"{t['all_global_mib']} MiB all-global ({t['copied_ratio']}x)"
    )
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
