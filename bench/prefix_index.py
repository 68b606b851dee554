"""Prefix index speed: match + insert (+ free) of long prompts, and a mixed trace.

    .venv/bin/python bench/prefix_index.py [--prompt-tokens 20000] [--json]

Warm path: the prompt's blocks are already cached (a full hit, capped at len - 1, so the last
block is a partial copy that commit dedupes). Cold path: a prompt never seen, every block is
hashed and inserted. For reference, ``hash_only`` is the chained blake2b of the whole prompt
(``block_hashes``): what a digest-keyed lookup would pay before any dict work; our match walks
the tree by token bytes instead and hashes only new blocks. Target: warm match + insert <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque

from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.model.progress import progress_bar

TARGET_US = 1000.0


def no_copy(src: int, dst: int, k: int) -> None:
    pass


def best_us(samples: list[float]) -> float:
    """Best of N: on a shared machine the minimum is the run least disturbed by other load."""
    return min(samples) * 1e6


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_long_prompt(tokens: int, block_size: int, repeats: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    blocks = 3 * (tokens // block_size + 2)
    bm = BlockManager(blocks, block_size, b"bench|tok|bf16", no_copy)
    prompt = [rng.randrange(150_000) for _ in range(tokens)]
    hash_only, warm, free, cold = [], [], [], []
    bar = progress_bar(f"{tokens}-token prompt, cold then warm", 2 * repeats)
    # cold: a fresh prompt each time, all blocks inserted
    for _ in range(repeats):
        fresh = [rng.randrange(150_000) for _ in range(tokens)]
        t0 = time.perf_counter()
        m = bm.match(fresh, "ns", tokens - 1)
        table = bm.allocate(fresh, "ns", m, tokens)
        bm.commit(table, fresh, tokens)
        cold.append(time.perf_counter() - t0)
        bm.free(table)
        bm.evict_all()
        bar.update()
    # warm: the same prompt again and again
    table = bm.allocate(prompt, "ns", bm.match(prompt, "ns", tokens - 1), tokens)
    bm.commit(table, prompt, tokens)
    bm.free(table)
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = bm.match(prompt, "ns", tokens - 1)
        table = bm.allocate(prompt, "ns", m, tokens)
        bm.commit(table, prompt, tokens)
        t1 = time.perf_counter()
        bm.free(table)
        t2 = time.perf_counter()
        bm.block_hashes(prompt, "ns")  # interleaved with the warm path: same machine state
        t3 = time.perf_counter()
        assert table.block_ids == [] and m.num_tokens == tokens - 1
        warm.append(t1 - t0)
        free.append(t2 - t1)
        hash_only.append(t3 - t2)
        bar.update()
    bar.close()
    bm.check_invariants()
    return {
        "hash_only_us": best_us(hash_only),
        "match_insert_us": best_us(warm),
        "match_insert_median_us": median_us(warm),
        "free_us": best_us(free),
        "cold_insert_us": best_us(cold),
        "cold_insert_median_us": median_us(cold),
    }


def bench_trace(
    num_prompts: int, num_prefixes: int, block_size: int, num_blocks: int, seed: int
) -> dict[str, float]:
    """Many prompts: a shared prefix (system prompt / document) of random length + a unique tail;
    16 live sequences at a time; a pool smaller than the working set, so eviction runs."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(150_000) for _ in range(rng.randrange(256, 4096))]
        for _ in range(num_prefixes)
    ]
    prompts = []
    for _ in range(num_prompts):
        base = rng.choice(prefixes)
        cut = rng.randrange(len(base) // 2, len(base) + 1)  # share a random-length prefix
        tail = [rng.randrange(150_000) for _ in range(rng.randrange(16, 512))]
        prompts.append((f"tenant-{rng.randrange(2)}", base[:cut] + tail))
    bm = BlockManager(num_blocks, block_size, b"bench|tok|bf16", no_copy)
    live: deque = deque()
    refused = 0
    bar = progress_bar("trace prompts", len(prompts))
    t0 = time.perf_counter()
    for ns, prompt in prompts:
        bar.update()  # a no-op when off; well under a microsecond when drawn
        m = bm.match(prompt, ns, len(prompt) - 1)
        while not bm.can_allocate(m, len(prompt)) and live:
            bm.free(live.popleft())
            m = bm.match(prompt, ns, len(prompt) - 1)
        if not bm.can_allocate(m, len(prompt)):
            refused += 1
            continue
        table = bm.allocate(prompt, ns, m, len(prompt))
        bm.commit(table, prompt, len(prompt))
        live.append(table)
        if len(live) > 16:
            bm.free(live.popleft())
    elapsed = time.perf_counter() - t0
    bar.close()
    while live:
        bm.free(live.popleft())
    bm.check_invariants()
    stats = bm.stats()
    return {
        "trace_prompts": num_prompts,
        "ops_per_s": (num_prompts - refused) / elapsed,
        "trace_tokens_per_s": stats.query_tokens / elapsed,
        "trace_hit_rate": stats.hit_tokens / max(1, stats.query_tokens),
        "trace_evicted_tokens": stats.evicted_tokens,
        "trace_refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=20_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--trace-prompts", type=int, default=2000)
    parser.add_argument("--trace-prefixes", type=int, default=16)
    parser.add_argument("--trace-blocks", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    long = bench_long_prompt(args.prompt_tokens, args.block_size, args.repeats, args.seed)
    trace = bench_trace(
        args.trace_prompts, args.trace_prefixes, args.block_size, args.trace_blocks, args.seed
    )
    k = args.prompt_tokens // 1000
    result = {
        "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size,
        "match_insert_us": round(long["match_insert_us"], 1),
        f"match_insert_us_{k}k": round(long["match_insert_us"], 1),
        f"match_insert_median_us_{k}k": round(long["match_insert_median_us"], 1),
        f"cold_insert_us_{k}k": round(long["cold_insert_us"], 1),
        f"cold_insert_median_us_{k}k": round(long["cold_insert_median_us"], 1),
        f"free_us_{k}k": round(long["free_us"], 1),
        f"hash_only_us_{k}k": round(long["hash_only_us"], 1),
        "warm_vs_target": round(TARGET_US / long["match_insert_us"], 3),
        "warm_vs_hash_only": round(long["match_insert_us"] / long["hash_only_us"], 3),
        **{key: round(v, 4) if isinstance(v, float) else v for key, v in trace.items()},
    }
    result["ops_per_s"] = round(trace["ops_per_s"], 1)
    print(f"{args.prompt_tokens}-token prompt, block {args.block_size}, best of {args.repeats}:")
    print(f"  warm match+insert  {long['match_insert_us']:9.1f} us  (target {TARGET_US:.0f} us,")
    print(f"                     {TARGET_US / long['match_insert_us']:.2f}x of target speed)")
    print(f"  warm median        {long['match_insert_median_us']:9.1f} us")
    print(f"  cold match+insert  {long['cold_insert_us']:9.1f} us")
    print(f"  free               {long['free_us']:9.1f} us")
    print(f"  hashing alone      {long['hash_only_us']:9.1f} us  (reference; warm is ", end="")
    print(f"{long['match_insert_us'] / long['hash_only_us']:.2f}x of it)")
    print(
        f"trace: {trace['trace_prompts']} prompts, {trace['ops_per_s']:.0f} prompts/s, "
        f"{trace['trace_tokens_per_s'] / 1e6:.2f} M tokens/s, hit rate {trace['trace_hit_rate']:.2f}"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
