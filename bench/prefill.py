"""Warm vs cold prefill: how much of the ideal prefix-reuse speedup the engine realises.

Cold: prefill P+S from nothing, in chunks of --chunk tokens (the engine's default per-step
budget, 2048; 0 = one step). Warm: P's KV is already cached; prefill S over it. The ideal
speedup is FLOPs(cold) / FLOPs(warm), counting the linear layers and attention (causal
triangle, one LM-head row per timed request); efficiency = measured / ideal.

    .venv/bin/python bench/prefill.py --prefix 20000 --suffix 1000 [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from flops import prefill_flops

from prefixcache.engine.attention import create_backend
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.model_config import ModelConfig
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

BLOCK = 16


def sized_model(base: LoadedModel, args: argparse.Namespace) -> LoadedModel:
    """The demo model's tokenizer with a random model of the sizes given by flags."""
    from prefixcache.engine.model.llama import LlamaForCausalLM

    raw = base.config.to_dict()
    for flag, key in [
        ("hidden", "hidden_size"),
        ("layers", "num_layers"),
        ("heads", "num_heads"),
        ("kv_heads", "num_kv_heads"),
        ("intermediate", "intermediate_size"),
    ]:
        if getattr(args, flag) is not None:
            raw[key] = getattr(args, flag)
    raw["head_dim"] = raw["hidden_size"] // raw["num_heads"]
    config = ModelConfig(**raw)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model = model.to(base.dtype).eval().requires_grad_(False)
    return LoadedModel(model, config, base.tokenizer, "sized", "sized", base.dtype, base.device)


def prefill(runner: ModelRunner, tokens: list[int], start: int, chunk: int) -> torch.Tensor:
    total = start + len(tokens)
    table = list(range(-(-total // BLOCK)))
    step = chunk if chunk > 0 else len(tokens)
    logits = torch.empty(0)
    for a in range(0, len(tokens), step):
        part = tokens[a : a + step]
        last = a + step >= len(tokens)
        logits = runner.execute([BatchEntry(part, start + a, table, compute_logits=last)])
    return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prefix", type=int, default=20000)
    ap.add_argument("--suffix", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=2048, help="cold prefill chunk (0: one step)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each (median)")
    ap.add_argument("--threads", type=int, default=None)
    for flag in ("hidden", "layers", "heads", "kv-heads", "intermediate"):
        ap.add_argument(f"--{flag}", type=int, default=None, help="size override")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if any(
        getattr(args, f) is not None
        for f in ("hidden", "layers", "heads", "kv_heads", "intermediate")
    ):
        loaded = sized_model(loaded, args)
    cfg = loaded.config
    total = args.prefix + args.suffix
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (total,), generator=gen).tolist()
    p_tokens, s_tokens = tokens[: args.prefix], tokens[args.prefix :]
    spec = loaded.kv_cache_spec(BLOCK)
    num_blocks = -(-total // BLOCK) + 1
    backend = create_backend(args.backend, args.device)

    def sync() -> None:
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()

    # Warm-up (thread pools, allocator, kernel dispatch) so the first timed run is not penalised.
    warmup = ModelRunner(loaded, KVCache(spec, 300), backend)
    prefill(warmup, tokens[:4096], 0, args.chunk)
    del warmup

    cold_times, warm_times = [], []
    cold_logits = warm_logits = torch.empty(0)
    for _ in progress_iter(range(args.repeat), "cold + warm prefill"):
        runner = ModelRunner(loaded, KVCache(spec, num_blocks), backend)
        sync()
        t0 = time.perf_counter()
        cold_logits = prefill(runner, tokens, 0, args.chunk)
        sync()
        cold_times.append(time.perf_counter() - t0)

        runner = ModelRunner(loaded, KVCache(spec, num_blocks), backend)
        prefill(runner, p_tokens, 0, args.chunk)  # cache P (untimed)
        sync()
        t0 = time.perf_counter()
        warm_logits = prefill(runner, s_tokens, args.prefix, args.chunk)
        sync()
        warm_times.append(time.perf_counter() - t0)

    cold_s, warm_s = statistics.median(cold_times), statistics.median(warm_times)
    flops_cold = prefill_flops(cfg, 0, total)
    flops_warm = prefill_flops(cfg, args.prefix, args.suffix)
    speedup = cold_s / warm_s
    ideal = flops_cold / flops_warm
    max_diff = float((cold_logits - warm_logits).abs().max())
    result = {
        "model": loaded.name,
        "dtype": args.dtype,
        "device": str(loaded.device),
        "backend": backend.name,
        "threads": torch.get_num_threads(),
        "prefix": args.prefix,
        "suffix": args.suffix,
        "cold_chunk": args.chunk,
        "cold_s": round(cold_s, 4),
        "warm_s": round(warm_s, 4),
        "speedup": round(speedup, 3),
        "ideal_speedup": round(ideal, 3),
        "efficiency": round(speedup / ideal, 3),
        "cold_gflops_per_s": round(flops_cold / cold_s / 1e9, 2),
        "warm_gflops_per_s": round(flops_warm / warm_s / 1e9, 2),
        "max_logit_diff_cold_vs_warm": max_diff,
    }
    chunking = f"chunks of {args.chunk}" if args.chunk > 0 else "one step"
    print(
        f"model {loaded.name} {args.dtype} on {loaded.device} ({backend.name} backend), "
        f"P={args.prefix} S={args.suffix}, cold prefill in {chunking}"
    )
    print(f"cold prefill P+S : {cold_s:8.3f} s  ({result['cold_gflops_per_s']} GFLOP/s)")
    print(f"warm prefill S|P : {warm_s:8.3f} s  ({result['warm_gflops_per_s']} GFLOP/s)")
    print(
        f"speedup {speedup:.2f}x, ideal {ideal:.2f}x (FLOPs cold/warm incl. attention), "
        f"efficiency {speedup / ideal:.3f}"
    )
    print(f"max |logits cold - warm| = {max_diff:.2e}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
