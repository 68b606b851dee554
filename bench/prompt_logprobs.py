"""Scoring prompts (``echo`` + ``logprobs``, lm-evaluation-harness's loglikelihood requests):
what a prompt's logprobs cost on top of computing it.

For each prompt length L: the time to compute L tokens cold and sample one (the baseline), and
the same with ``prompt_logprobs`` (every prompt row through the LM head, a log-softmax, the
top k). The ideal ratio counts FLOPs: the head's on every row against one row (bench/flops.py);
the rest (log-softmax, top-k, Python objects per position) is the overhead over it.

    .venv/bin/python bench/prompt_logprobs.py [--model smollm2] [--lengths 256 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from flops import prefill_flops

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import EngineRequest, SamplingParams


def seconds(engine: LLMEngine, rid: str, prompt: list[int], sampling: SamplingParams) -> float:
    engine.evict_all()  # cold every time
    start = time.perf_counter()
    engine.generate([EngineRequest(rid, prompt, sampling)])
    return time.perf_counter() - start


def measure(loaded: LoadedModel, length: int, top: int, runs: int) -> dict:
    vocab = loaded.config.vocab_size
    rng = random.Random(length)
    prompt = [rng.randrange(10, vocab) for _ in range(length)]
    config = EngineConfig(
        model=loaded.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device="cpu",
        num_blocks=length // 16 + 64,
    )
    engine = LLMEngine(config, loaded)
    plain = SamplingParams(max_tokens=1)
    scored = SamplingParams(max_tokens=1, logprobs=top, prompt_logprobs=top)
    seconds(engine, "warmup", prompt[:64], scored)
    base, score = [], []
    for i in range(runs):  # alternated, so drift hits both
        base.append(seconds(engine, f"b{i}", prompt, plain))
        score.append(seconds(engine, f"s{i}", prompt, scored))
    c = loaded.config
    head = 2 * c.hidden_size * c.vocab_size
    ideal = (prefill_flops(c, 0, length) + head * (length - 2)) / prefill_flops(c, 0, length)
    ratio = statistics.median(score) / statistics.median(base)
    return {
        "prompt_tokens": length,
        "top": top,
        "plain_ms": round(statistics.median(base) * 1e3, 1),
        "scored_ms": round(statistics.median(score) * 1e3, 1),
        "ratio": round(ratio, 3),
        "ideal_ratio": round(ideal, 3),
        "overhead_vs_ideal": round(ratio / ideal, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--top", type=int, default=1, help="logprobs=k, as lm-eval's 1")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    rows = [
        measure(loaded, n, args.top, args.runs)
        for n in progress_iter(args.lengths, "prompt lengths")
    ]
    result = {
        "cpu": cpu_model_name(),
        "model": args.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "rows": rows,
    }
    for r in rows:
        print(
            f"{r['prompt_tokens']} tokens: plain {r['plain_ms']} ms, scored {r['scored_ms']} ms: "
            f"{r['ratio']}x (ideal {r['ideal_ratio']}x, {r['overhead_vs_ideal']}x of it)"
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
