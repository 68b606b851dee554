"""Burst of N requests sharing one long system prompt: is the prefix computed once?

Prints prompt tokens computed vs the ideal (P + N*S), peak KV blocks vs the ideal, and the
time until every request has its first token with prefix caching on vs off.

    python bench/burst.py                      # N=256, P=2000, S=32 (the no-cache run is slow)
    python bench/burst.py --n 32 --prefix 512 --json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_bar
from prefixcache.engine.request import EngineRequest, SamplingParams
from prefixcache.engine.step.engine_hooks import EngineHooks


class PeakBlocks:
    """The high-water mark of blocks held by requests (an ``on_schedule`` hook)."""

    def __init__(self) -> None:
        self.peak = 0

    def __call__(self, out: object, used_blocks: int) -> None:
        self.peak = max(self.peak, used_blocks)


def run(
    engine: LLMEngine, peak: PeakBlocks, prompts: list[list[int]], max_tokens: int, label: str
) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(f"burst-{i}", prompt, params), arrival_time=time.monotonic()
        )
    first_token: set[str] = set()
    computed = 0
    all_first_s = math.nan
    bar = progress_bar(f"burst {label}: requests finished", len(prompts))
    while engine.has_unfinished:
        for out in engine.step():
            first_token.add(out.request_id)
            if out.finished:
                computed += out.usage.computed_prompt_tokens
                bar.update()
        if len(first_token) == len(prompts) and math.isnan(all_first_s):
            all_first_s = time.perf_counter() - start
    bar.close()
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    return {
        "all_first_token_s": all_first_s,
        "computed": computed,
        "peak_blocks": peak.peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--n", type=int, default=256, help="concurrent requests")
    parser.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens P")
    parser.add_argument("--suffix", type=int, default=32, help="unique suffix tokens S")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-nocache", action="store_true", help="only the cached run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    # Suffixes start with distinct tokens, so the only shared part is the prefix (the ideal).
    firsts = rng.sample(range(3, vocab), args.n)
    prompts = [
        prefix + [first] + [rng.randrange(3, vocab) for _ in range(args.suffix - 1)]
        for first in firsts
    ]
    block_size = 16
    per_request = args.prefix + args.suffix + args.max_tokens
    num_blocks = args.n * math.ceil(per_request / block_size) + 64  # room for the no-cache run

    def engine(caching: bool) -> LLMEngine:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            num_blocks=num_blocks,
            max_num_batched_tokens=args.max_batched_tokens,
            max_num_seqs=max(args.n, 1),
            enable_prefix_caching=caching,
        )
        peak = PeakBlocks()
        return LLMEngine(config, loaded, EngineHooks(on_schedule=peak)), peak

    cached = run(*engine(True), prompts, args.max_tokens, "cached")
    uncached = (
        None if args.skip_nocache else run(*engine(False), prompts, args.max_tokens, "no cache")
    )

    ideal_tokens = args.prefix + args.n * args.suffix
    ideal_blocks = math.ceil(args.prefix / block_size) + args.n * math.ceil(
        (args.prefix % block_size + args.suffix) / block_size
    )
    result = {
        "n": args.n,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "dtype": args.dtype,
        "prompt_tokens_computed": cached["computed"],
        "ideal_tokens": ideal_tokens,
        "nocache_tokens_computed": uncached["computed"] if uncached else None,
        "peak_blocks": cached["peak_blocks"],
        "ideal_blocks": ideal_blocks,
        "cached_all_first_token_s": round(cached["all_first_token_s"], 4),
        "nocache_all_first_token_s": round(uncached["all_first_token_s"], 4) if uncached else None,
        "speedup_vs_nocache": (
            round(uncached["all_first_token_s"] / cached["all_first_token_s"], 2)
            if uncached
            else None
        ),
        "ideal_speedup": round(args.n * (args.prefix + args.suffix) / ideal_tokens, 2),
    }
    print(f"burst: N={args.n} P={args.prefix} S={args.suffix} dtype={args.dtype}")
    print(f"  prompt tokens computed {result['prompt_tokens_computed']} (ideal {ideal_tokens})")
    print(
        f"  peak KV blocks         {result['peak_blocks']} (ideal {ideal_blocks}, bound {ideal_blocks + args.n})"
    )
    print(f"  all first tokens       cached {result['cached_all_first_token_s']} s", end="")
    if uncached:
        print(
            f", no cache {result['nocache_all_first_token_s']} s, speedup {result['speedup_vs_nocache']}x (token ideal {result['ideal_speedup']}x)"
        )
    else:
        print()
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
