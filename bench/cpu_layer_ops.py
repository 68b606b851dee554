"""The fused CPU layer ops (``engine/cpu_layer_ops``) against torch's unfused bf16 ops.

- ops: each op at a decode size (``--decode-rows``, 32) and a prefill size
  (``--prefill-rows``, 2048) with the model's hidden/intermediate/head sizes: fused time,
  torch time, ratio (torch / fused);
- engine: ``LLMEngine`` in-process, ``--seqs`` sequences of ``--prompt`` random tokens, the
  time of one steady decode step (every sequence decoding) with the fused ops and with
  torch's ops (the same engine, the model's flags switched), alternated ``--rounds`` times.

Medians throughout (the box is shared); wall time at the configured threads.

    .venv/bin/python bench/cpu_layer_ops.py [--model /tmp/bench-llama55m] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels import cpu_layer_ops
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model import layer_ops
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import EngineRequest, SamplingParams


def per_call_us(fn: Callable[[], object], calls: int, repeat: int) -> float:
    fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs) * 1e6


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def op_cases(
    rows: int, hidden: int, inter: int, hq: int, hk: int, d: int
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (fused call, torch call) on random bf16 operands of the engine's shapes."""
    gen = torch.Generator().manual_seed(rows)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    x, residual, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    gate_up = rand(rows, 2 * inter)
    qkv = rand(rows, (hq + 2 * hk) * d)
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(rows, hk, d)
    freqs = torch.rand(rows, d // 2, generator=gen) * 100
    cos, sin = freqs.cos().to(torch.bfloat16)[:, None], freqs.sin().to(torch.bfloat16)[:, None]

    def torch_add_norm() -> object:
        r = residual + x
        return torch_norm(r, w, 1e-5), r

    return {
        "rms_norm": (
            lambda: cpu_layer_ops.rms_norm(x, w, 1e-5),
            lambda: torch_norm(x, w, 1e-5),
        ),
        # in place: x and residual are overwritten on each call, at the same cost
        "add_rms_norm": (
            lambda: cpu_layer_ops.fused_add_rms_norm(x, residual, w, 1e-5),
            torch_add_norm,
        ),
        "rotary_q_k": (
            lambda: cpu_layer_ops.rotary_(q, k, cos, sin),
            lambda: (layer_ops._rotate(q, cos, sin), layer_ops._rotate(k, cos, sin)),
        ),
        "silu_and_mul": (
            lambda: cpu_layer_ops.silu_and_mul(gate_up),
            lambda: F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]),
        ),
        "gelu_tanh_and_mul": (
            lambda: cpu_layer_ops.gelu_tanh_and_mul(gate_up),
            lambda: F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:],
        ),
    }


def decode_step_ms(engine: LLMEngine, args: argparse.Namespace) -> dict[str, float]:
    model = engine.runner.model
    assert model.fused_ops, "prepare() did not switch the fused ops on"
    engine.runner.replay = None  # both arms eager: the ops compared, not the step replay
    rng = random.Random(0)
    vocab = engine.loaded.config.vocab_size
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.seqs):
        jitter = rng.randrange(-args.prompt // 4, args.prompt // 4 + 1)
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt + jitter)]
        engine.add_request(EngineRequest(f"s{i}", prompt, sampling))
    started: set[str] = set()
    while len(started) < args.seqs:  # prefill until every sequence decodes
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in progress_iter(range(args.rounds), "decode rounds"):
        for fused in (True, False):
            model.set_fused_ops(fused)
            engine.step()  # warm-up after the switch
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[fused].append((time.perf_counter() - start) / args.steps * 1000)
    model.set_fused_ops(True)
    fused_ms, torch_ms = statistics.median(times[True]), statistics.median(times[False])
    return {"fused_ms": fused_ms, "torch_ms": torch_ms, "ratio": torch_ms / fused_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/bench-llama55m", help="folder or 'demo'")
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument("--prefill-rows", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=550)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    reason = cpu_layer_ops.unavailable_reason()
    if reason is None and cpu_layer_ops.available() and not cpu_layer_ops.computes(torch.bfloat16):
        reason = "this build computes fp32 only (the bf16 ops need AVX512_BF16)"
    if reason is not None or not cpu_layer_ops.available():
        print(f"CPU layer ops unavailable here: {reason or 'build failed'}")
        if args.json:
            print(json.dumps({"available": False, "cpu": cpu_model_name()}))
        return
    config = EngineConfig(model=args.model, dtype="bfloat16", device="cpu")
    config.num_blocks = args.seqs * (-(-(args.prompt * 5 // 4 + args.max_tokens) // 16) + 1)
    engine = LLMEngine(config)
    cfg = engine.loaded.config
    dims = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    result: dict[str, object] = {"available": True, "cpu": cpu_model_name()}
    result["threads"] = torch.get_num_threads()
    ops: dict[str, dict[str, float]] = {}
    for rows in (args.decode_rows, args.prefill_rows):
        calls = max(1, 20_000 // rows)
        for name, (fused, plain) in op_cases(rows, *dims).items():
            fused_us = per_call_us(fused, calls, args.repeat)
            torch_us = per_call_us(plain, calls, args.repeat)
            ops[f"{name}@{rows}"] = {
                "fused_us": round(fused_us, 2),
                "torch_us": round(torch_us, 2),
                "ratio": round(torch_us / fused_us, 2),
            }
            print(
                f"{name:>17} {rows:5d} rows: fused {fused_us:8.1f} us, torch {torch_us:8.1f} us,"
                f" {torch_us / fused_us:5.2f}x"
            )
    result["ops"] = ops
    step = decode_step_ms(engine, args)
    result["decode_step"] = {key: round(value, 3) for key, value in step.items()}
    print(
        f"decode step, {args.seqs} seqs of ~{args.prompt} tokens: fused {step['fused_ms']:.2f} ms,"
        f" torch {step['torch_ms']:.2f} ms, {step['ratio']:.2f}x"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
