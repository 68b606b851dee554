"""The fixed cost of a batch-1 decode step: what the engine spends per token beyond the
arithmetic and the weight reads.

Two engines decode one stream each, step by step: the real model (``--model``, default
``smollm2``) and its *skinny twin*, the same architecture, layer count, heads, vocabulary and
dtype with hidden 64, head dim 32 and intermediate 128 (random weights). The twin's kernels
do almost no work, so its step time is the per-step fixed cost: Python, the ctypes calls,
tensor allocation, the OpenMP teams' start and join, the scheduler and the sampler. The real
step is compared with the memory floor too (the weights it reads once, over the bandwidth a
``torch.sum`` streams at here).

Prints the medians and ``fixed / real`` (the share of a step that is not arithmetic or
weight reads) and ``real / floor``; each with the step replayed (``step/step_replay.py``, the
default where it applies) and eager (every kernel called from Python), and ``replayed /
eager``.

    .venv/bin/python bench/step_overhead.py [--model smollm2] [--gguf-weights dequantized]
        [--tokens 128] [--rounds 3] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.kernels.linear import Gemm
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.model.quantized_linear import quantized_bytes
from prefixcache.engine.model.registry import causal_lm_class
from prefixcache.engine.request import EngineRequest, SamplingParams


def skinny_twin(loaded: LoadedModel) -> LoadedModel:
    """``loaded``'s architecture at hidden 64 (head dim 32, intermediate 128), random weights."""
    cfg = loaded.config
    heads, kv_heads = min(cfg.num_heads, 2), min(cfg.num_kv_heads, 2)
    heads = max(kv_heads, heads - heads % kv_heads)
    config = dataclasses.replace(
        cfg, hidden_size=64, head_dim=32, intermediate_size=128, num_heads=heads,
        num_kv_heads=kv_heads,
    )  # fmt: skip
    torch.manual_seed(0)
    model = causal_lm_class(config)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model = model.to(loaded.dtype).eval().requires_grad_(False)
    return dataclasses.replace(
        loaded, model=model, config=config, fingerprint=f"{loaded.fingerprint}-skinny"
    )


def step_times(engine: LLMEngine, prompt: list[int], tokens: int, tag: str) -> list[float]:
    """Seconds of each decode step (the prefill step left out)."""
    engine.add_request(
        EngineRequest(tag, prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    )
    times = []
    engine.step()  # the prefill
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def bandwidth_gb_s(gib: float) -> float:
    """GB/s a torch.sum streams over ``gib`` GiB (the best of 5)."""
    buf = torch.ones(int(gib * (1 << 28)), dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: each GEMM's own copy once (its bf16 panels
    or GGUF blocks, what a one-row call reads; prepare() lets the checkpoint's tensors go),
    the GGUF-quantized weights, the norms. The embedding lookup reads one row: not counted."""
    total = quantized_bytes(model)
    projections = [model.head]
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        projections += [a.qkv, a.out, m.gate_up, m.down]
    for p in projections:
        if isinstance(p, Gemm):
            w = p.weight if p.invariant is None else p.invariant.packed
            total += w.numel() * w.element_size()
    norms = (t for name, t in model.named_parameters() if "norm" in name)
    return total + sum(t.numel() * t.element_size() for t in norms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gguf-weights", default="dequantized")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--gib", type=float, default=1.0, help="buffer of the bandwidth reading")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype=args.dtype, device="cpu", gguf_weights=args.gguf_weights)
    twin = skinny_twin(loaded)
    engines = {}
    for name, model in (("real", loaded), ("fixed", twin)):
        for mode in ("", "eager_"):
            config = EngineConfig(
                model=args.model, dtype=str(loaded.dtype).removeprefix("torch."), device="cpu",
                max_model_len=args.tokens + 128, gguf_weights=args.gguf_weights,
            )  # fmt: skip
            engine = engines[mode + name] = LLMEngine(config, model)
            if mode:
                engine.runner.replay = None
    prompt = list(range(100, 164))
    medians: dict[str, list[float]] = {name: [] for name in engines}
    for r in progress_iter(range(args.rounds), "rounds"):
        for name, engine in engines.items():
            engine.evict_all()
            medians[name].append(statistics.median(step_times(engine, prompt, args.tokens, f"{r}")))
    real, fixed = statistics.median(medians["real"]), statistics.median(medians["fixed"])
    eager_real = statistics.median(medians["eager_real"])
    eager_fixed = statistics.median(medians["eager_fixed"])
    gb_s = bandwidth_gb_s(args.gib)
    weights = weight_bytes(engines["real"].runner.model)
    floor = weights / (gb_s * 1e9)
    result = {
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "model": args.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "gguf_weights": args.gguf_weights,
        "layers": loaded.config.num_layers,
        "real_step_ms": round(real * 1e3, 3),
        "fixed_step_ms": round(fixed * 1e3, 3),
        "fixed_per_layer_us": round(fixed * 1e6 / loaded.config.num_layers, 1),
        "fixed_share": round(fixed / real, 3),
        "weight_bytes": weights,
        "bandwidth_gb_s": round(gb_s, 1),
        "floor_ms": round(floor * 1e3, 3),
        "real_over_floor": round(real / floor, 2),
        "tok_s": round(1 / real, 1),
        "replayed": engines["real"].runner.replay is not None,
        "replay_off_reason": engines["real"].runner.replay_off_reason,
        "eager_real_step_ms": round(eager_real * 1e3, 3),
        "eager_fixed_step_ms": round(eager_fixed * 1e3, 3),
        "replayed_over_eager": round(real / eager_real, 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['cpu']}, {result['threads']} threads, {args.model} {result['dtype']}")
    print(
        f"decode step, batch 1: real {real * 1e3:.2f} ms ({1 / real:.1f} tok/s), skinny twin "
        f"{fixed * 1e3:.2f} ms ({result['fixed_per_layer_us']} us a layer): fixed / real "
        f"{fixed / real:.2f}"
    )
    print(
        f"eager (every kernel called from Python): real {eager_real * 1e3:.2f} ms, twin "
        f"{eager_fixed * 1e3:.2f} ms; replayed / eager {real / eager_real:.2f}"
        + ("" if result["replayed"] else f" (replay off: {result['replay_off_reason']})")
    )
    print(
        f"floor: {weights / 1e6:.0f} MB of weights at {gb_s:.1f} GB/s = {floor * 1e3:.2f} ms; "
        f"real / floor {real / floor:.2f}"
    )


if __name__ == "__main__":
    main()
