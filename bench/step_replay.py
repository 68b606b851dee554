"""A step replayed (``step/step_replay.py``) against the same step eager, by tokens a step.

One sequence with ``--context`` cached tokens; each step computes T new tokens over it (a
decode at T = 1, a chunk or a warm request's suffix above), through ``ModelRunner.execute``
with the replay on and off on the same runner, alternated. Prints each T's medians and
``replayed / eager``: where the per-call Python it removes stops mattering.

    .venv/bin/python bench/step_replay.py [--model smollm2] [--gguf-weights dequantized]
        [--tokens 1,8,32,64,128,256,512] [--context 1024] [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prefixcache.engine.attention import create_backend
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner
from prefixcache.engine.step.step_replay import StepReplay

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gguf-weights", default="dequantized")
    ap.add_argument("--tokens", default="1,8,32,64,128,256,512")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", gguf_weights=args.gguf_weights)
    blocks = -(-(args.context + max(sizes)) // BLOCK)
    cache = KVCache(loaded.kv_cache_spec(BLOCK), blocks + 1)
    runner = ModelRunner(loaded, cache, create_backend("auto", "cpu"))
    if runner.replay is None:
        raise SystemExit(f"the step does not replay here: {runner.replay_off_reason}")
    # this bench's own replay, sized for its largest step (the runner's stops at MAX_TOKENS)
    replay = StepReplay(runner.model, runner.backend, cache.layers, max(sizes))  # type: ignore[arg-type]
    table = list(range(1, blocks + 1))
    runner.execute([BatchEntry(list(range(100, 100 + args.context)), 0, table, False)])
    rows = []
    for t in progress_iter(sizes, "token counts"):
        times: dict[str, list[float]] = {"eager": [], "replayed": []}
        step = [BatchEntry([(200 + i) % 1000 for i in range(t)], args.context, table)]
        for _ in range(args.repeat):
            for mode in times:
                runner.replay = replay if mode == "replayed" else None
                start = time.perf_counter()
                runner.execute(step)
                times[mode].append(time.perf_counter() - start)
        eager = statistics.median(times["eager"][1:]) * 1e3
        replayed = statistics.median(times["replayed"][1:]) * 1e3
        rows.append(
            {"tokens": t, "eager_ms": round(eager, 3), "replayed_ms": round(replayed, 3),
             "replayed_over_eager": round(replayed / eager, 3)}
        )  # fmt: skip
    result = {
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "model": args.model,
        "gguf_weights": args.gguf_weights,
        "context": args.context,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['cpu']}, {result['threads']} threads, {args.model}, {args.context} cached")
    for r in rows:
        print(
            f"{r['tokens']:4d} tokens a step: eager {r['eager_ms']:8.2f} ms, replayed "
            f"{r['replayed_ms']:8.2f} ms, replayed / eager {r['replayed_over_eager']:.2f}"
        )


if __name__ == "__main__":
    main()
