"""Hit rate against KV pool size: a trace of requests over a few popular system prompts.

The trace: ``--prompts`` system prompts of ``--prefix`` tokens with Zipf(1.1) popularity, each
request one of them plus a ``--suffix``-token question of its own. Requests run one after
another through the block manager alone (match, allocate, commit, free: what the engine does
per request, without the model), so the figure is the cache policy's, not the machine's.
The ideal is the hit rate of an unbounded pool.

    python bench/hit_rate.py --json
    python bench/hit_rate.py --pools 64,256,1024 --requests 500
"""

from __future__ import annotations

import argparse
import json
import random

from prefixcache.engine.memory.block_manager import BlockManager
from prefixcache.engine.memory.block_types import ManagerStats
from prefixcache.engine.model.progress import progress_iter

BLOCK = 16


def trace(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.prefix)] for _ in range(args.prompts)]
    weights = [1 / (k + 1) ** 1.1 for k in range(args.prompts)]
    out = []
    for _ in range(args.requests):
        system = rng.choices(prompts, weights)[0]
        out.append(system + [rng.randrange(3, 30000) for _ in range(args.suffix)])
    return out


def replay(requests: list[list[int]], num_blocks: int) -> ManagerStats:
    """The trace through a pool of ``num_blocks``, one request after another, as the engine
    does per request (match, allocate, commit, free), without the model."""
    manager = BlockManager(num_blocks, BLOCK, identity=b"bench")
    for prompt in requests:
        match = manager.match(prompt, "", len(prompt) - 1)
        table = manager.allocate(prompt, "", match, len(prompt))
        manager.commit(table, prompt, len(prompt))
        manager.free(table)
    return manager.stats()


def hit_rate(requests: list[list[int]], num_blocks: int) -> dict:
    stats = replay(requests, num_blocks)
    return {
        "pool_blocks": num_blocks,
        "hit_rate": round(stats.hit_tokens / stats.query_tokens, 4),
        "evicted_blocks": stats.evicted_tokens // BLOCK,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40, help="distinct system prompts")
    ap.add_argument("--prefix", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--suffix", type=int, default=64, help="question tokens")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--pools", default="128,256,512,1024,2048,4096", help="pool sizes, blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    requests = trace(args)
    pools = [int(p) for p in args.pools.split(",")]
    need = max(len(r) for r in requests) // BLOCK + 2
    rows = [hit_rate(requests, max(p, need)) for p in progress_iter(pools, "pool sizes")]
    ideal = hit_rate(requests, sum(len(r) for r in requests) // BLOCK + 2)["hit_rate"]
    working_set = args.prompts * (args.prefix // BLOCK)
    for row in rows:
        print(f"pool {row['pool_blocks']:6d} blocks: hit rate {row['hit_rate']:.3f}")
    print(f"unbounded pool: {ideal:.3f} (system prompts: {working_set} blocks)")
    result = {
        "prompts": args.prompts,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "requests": args.requests,
        "working_set_blocks": working_set,
        "ideal_hit_rate": ideal,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
