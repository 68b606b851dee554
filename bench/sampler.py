"""A sampled row's cost: the engine's sampler (``engine/step/sampler.py``) against the
definition written plainly (every probability sorted for top-p, ``torch.multinomial`` for the
draw, in torch's float64 ops), per vocabulary size and sampling option.

The logits are a language model's shape, not noise: a Zipf-like fall from the most likely
token (``--slope``), shuffled, so that top-p's nucleus holds tens to hundreds of tokens, as a
next token's does. Greedy is the batch-of-one argmax (``first_argmax`` against
``torch.argmax``). Prints each option's median ms a row, both ways, and the ratio.

    .venv/bin/python bench/sampler.py [--vocab 49152 262144] [--rounds 200] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import SamplingParams
from prefixcache.engine.step.sampler import Sampler, first_argmax

OPTIONS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "min_p 0.05 + top_p 0.9": SamplingParams(temperature=0.7, min_p=0.05, top_p=0.9),
}


def plain_sample(row: torch.Tensor, p: SamplingParams) -> int:
    """The definition: float64, every probability sorted for top-p, multinomial's draw."""
    scaled = row.to(torch.float64) / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    if 0 < p.top_k < scaled.shape[-1]:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, p.top_k).values[-1], -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        values, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(values, dim=-1) - values < p.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order, values * keep)
    return int(torch.multinomial(probs, 1))


def lm_logits(vocab: int, slope: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = -slope * torch.log(ranks) + 0.3 * torch.randn(vocab, generator=gen)
    return logits[torch.randperm(vocab, generator=gen)].contiguous()


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--slope", type=float, default=1.2, help="logit fall per log rank")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sampler = Sampler()
    rows: dict[str, dict[str, dict[str, float]]] = {}
    cases = [(v, name) for v in args.vocab for name in ["greedy", *OPTIONS]]
    for vocab, name in progress_iter(cases, "sampling options"):
        logits = lm_logits(vocab, args.slope, seed=vocab)
        if name == "greedy":
            batch = logits.view(1, -1)
            ours = median_ms(functools.partial(first_argmax, batch), args.rounds)
            plain = median_ms(functools.partial(torch.argmax, batch, dim=-1), args.rounds)
        else:
            p = OPTIONS[name]
            ours = median_ms(functools.partial(sampler._sample_row, logits, p, "b"), args.rounds)
            plain = median_ms(functools.partial(plain_sample, logits, p), args.rounds)
        rows.setdefault(str(vocab), {})[name] = {
            "ms": round(ours, 3),
            "plain_ms": round(plain, 3),
            "speedup": round(plain / ours, 2),
        }
    print(f"CPU: {cpu_model_name()}, {torch.get_num_threads()} threads; ms a row (median)")
    for vocab, options in rows.items():
        for name, r in options.items():
            print(
                f"  vocab {vocab:>7} {name:24s} {r['ms']:8.3f} ms, plain {r['plain_ms']:8.3f} ms: "
                f"{r['speedup']}x"
            )
    if args.json:
        print(json.dumps({"cpu": cpu_model_name(), "rows": rows}))


if __name__ == "__main__":
    main()
