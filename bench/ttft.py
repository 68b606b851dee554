"""Time to first token, cold vs warm, through the whole engine (scheduler, chunked prefill).

Two prompts: a coding assistant (8K instructions, 30K repository context, 10K conversation,
2K new request) and a plain 20K prefix + 1K suffix. Cold: an empty cache. Warm: the same
prefix cached by an earlier request, a new final part. The ideal speedup is the FLOP ratio.

    python bench/ttft.py                     # full sizes (minutes on a 2-core CPU)
    python bench/ttft.py --scale 0.1 --json  # everything 10x smaller
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

from flops import prefill_flops

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.progress import progress_bar
from prefixcache.engine.request import EngineRequest, SamplingParams

Clock = Callable[[], float]


def time_to_first_token(
    engine: LLMEngine, request_id: str, prompt: list[int], clock: Clock = time.perf_counter
) -> float:
    start = clock()
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1)))
    while engine.has_unfinished:
        engine.step()
    return clock() - start


def measure(
    loaded: LoadedModel,
    parts: list[int],
    budget: int,
    rng: random.Random,
    clock: Clock = time.perf_counter,
) -> dict:
    """``parts``: token lengths; the last part is the per-request one. ``clock``: wall time by
    default; ``time.thread_time`` counts this thread's CPU only (torch at one thread)."""
    vocab = loaded.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(sum(parts[:-1]))]
    tail_a = [rng.randrange(3, vocab) for _ in range(parts[-1])]
    tail_b = [rng.randrange(3, vocab) for _ in range(parts[-1])]
    total = len(prefix) + parts[-1]
    config = EngineConfig(
        model=loaded.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device="cpu",
        num_blocks=total // 16 * 2 + 64,
        max_num_batched_tokens=budget,
    )
    engine = LLMEngine(config, loaded)
    time_to_first_token(engine, "warmup", prefix[:64] + tail_a[:8])  # first-call costs
    engine.evict_all()
    cold = time_to_first_token(engine, "cold", prefix + tail_a, clock)
    warm = time_to_first_token(engine, "warm", prefix + tail_b, clock)
    ideal = prefill_flops(loaded.config, 0, total) / prefill_flops(
        loaded.config, len(prefix), parts[-1]
    )
    speedup = cold / warm
    return {
        "tokens": total,
        "cached": len(prefix),
        "cold_s": round(cold, 4),
        "warm_s": round(warm, 4),
        "speedup": round(speedup, 2),
        "ideal_speedup": round(ideal, 2),
        "efficiency": round(speedup / ideal, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every length")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    rng = random.Random(0)

    def scaled(*lengths: int) -> list[int]:
        return [max(1, int(n * args.scale)) for n in lengths]

    with progress_bar("cold + warm TTFT", 2) as bar:
        coding = measure(loaded, scaled(8000, 30000, 10000, 2000), args.max_batched_tokens, rng)
        bar.update()
        plain = measure(loaded, scaled(20000, 1000), args.max_batched_tokens, rng)
        bar.update()
    for name, r in (("coding assistant", coding), ("prefix + suffix", plain)):
        print(
            f"{name:17s} {r['tokens']:6d} tokens ({r['cached']} cached): cold {r['cold_s']:.3f} s,"
            f" warm {r['warm_s']:.3f} s, speedup {r['speedup']}x of ideal {r['ideal_speedup']}x"
            f" (efficiency {r['efficiency']})"
        )
    if args.json:
        summary = {
            "dtype": args.dtype,
            "scale": args.scale,
            "cold_s": coding["cold_s"],
            "warm_s": coding["warm_s"],
            "speedup": coding["speedup"],
            "ideal_speedup": coding["ideal_speedup"],
            "coding_assistant": coding,
            "prefix_suffix": plain,
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
