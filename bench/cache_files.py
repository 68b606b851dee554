"""A pinned prefix across a restart: loading its saved KV vs computing it again.

    .venv/bin/python bench/cache_files.py [--prefix 20000] [--json]

Engine A computes and pins a P-token prefix and saves it (``LLMEngine.save_pinned``). Then, in
fresh engines (a restart): baseline, the first request over that prefix computes it; ours,
``load_pinned`` and then the same request, which hits the loaded blocks. Reports save and load
times, the file size, time to first token both ways and their ratio; the request's logprobs are
compared between the two (the loaded KV must be the KV the prefix computes).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_bar
from prefixcache.engine.request import EngineRequest, SamplingParams


def first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, list[float], int]:
    """Seconds to the first token, its top logprobs, and the prompt tokens served from cache."""
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=5)
    start = time.perf_counter()
    result = engine.generate([EngineRequest(f"q{time.perf_counter_ns()}", prompt, sampling)])[0]
    elapsed = time.perf_counter() - start
    return elapsed, [lp for _, lp in result.logprobs[0].top], result.usage.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prefix", type=int, default=20000, help="pinned prefix tokens")
    parser.add_argument("--suffix", type=int, default=64, help="the request's own tokens")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    blocks = (args.prefix + args.suffix) // 16 + 64

    def engine() -> LLMEngine:
        config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", num_blocks=blocks)
        return LLMEngine(config, loaded)

    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    prompt = prefix + [rng.randrange(3, vocab) for _ in range(args.suffix)]

    bar = progress_bar("warm, save, cold, load, warm", 5)
    source = engine()
    source.generate([EngineRequest("warm", prefix, SamplingParams(max_tokens=1))])
    pinned_blocks = source.pin(prefix, "")
    bar.update()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pinned.safetensors"
        start = time.perf_counter()
        saved = source.save_pinned(path)
        save_s = time.perf_counter() - start
        del source
        bar.update()

        cold_s, cold_logprobs, _ = first_token(engine(), prompt)
        bar.update()

        restarted = engine()
        start = time.perf_counter()
        restarted.load_pinned(path)
        load_s = time.perf_counter() - start
        bar.update()
        warm_s, warm_logprobs, cached = first_token(restarted, prompt)
        bar.update()
    bar.close()

    max_diff = max(abs(a - b) for a, b in zip(cold_logprobs, warm_logprobs, strict=True))
    result = {
        "bench": "cache_files",
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "dtype": args.dtype,
        "pinned_blocks": pinned_blocks,
        "file_mib": round(saved.bytes / 2**20, 1),
        "save_s": round(save_s, 3),
        "load_s": round(load_s, 3),
        "cold_first_token_s": round(cold_s, 3),
        "loaded_first_token_s": round(warm_s, 3),
        "cached_tokens": cached,
        "speedup": round(cold_s / (load_s + warm_s), 1),
        "max_logprob_diff": max_diff,
    }
    print(
        f"pinned prefix: {args.prefix} tokens, {pinned_blocks} blocks, file {result['file_mib']} MiB"
    )
    print(f"save {save_s:.3f} s; load {load_s:.3f} s")
    print(f"after a restart, first token: computed {cold_s:.3f} s; loaded {warm_s:.3f} s + load")
    print(
        f"ratio {result['speedup']}x (load + first token vs computing the prefix); "
        f"{cached} tokens cached; logprobs differ by {max_diff:.2e}"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
