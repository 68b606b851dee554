"""GGUF weights kept quantized (``kernels/cpu_qgemm``) against the dequantized GEMM in the
same dtype (``kernels/cpu_gemm.PackedLinear``), both batch-invariant.

- gemm: per GGUF type and row count M (``--rows``), one ``[n, k]`` weight (``--shapes``,
  e.g. SmolLM2's gate/up 3072x576 and its tied head 49152x576) of random blocks: ms of the
  quantized kernel and of the dense GEMM on the same weight dequantized, GB/s of weight bytes
  read (packed bytes / time), ratio dense ms / quantized ms (above 1: quantized is faster);
- decode: single-stream greedy decode through ``LLMEngine`` on a GGUF (``--model``, default
  the named ``smollm2``, every block weight Q4_1, embedding Q8_0), quantized and dequantized
  engines in one process, rounds alternated; tok/s of the decode steps (first token excluded).

``--dtype``: the activations' dtype, bfloat16 (AVX512_BF16 CPUs) or float32 (AVX2 + FMA);
``auto`` (default) is bfloat16 where the kernel computes it, else float32. Medians throughout
(the box may be shared).

    .venv/bin/python bench/qgemm.py [--threads 2] [--dtype auto] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from row_decode import per_call_ms

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels import cpu_gemm, cpu_qgemm
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.gguf_blocks import split_blocks
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.model.quantized_linear import quantized_bytes
from prefixcache.engine.request import EngineRequest, SamplingParams

TYPES = {"Q8_0": (34, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,))}
TYPES["Q4_K"] = (144, 256, (0, 2))  # bytes a block, weights a block, fp16 field offsets


def random_weight(
    type_name: str, n: int, k: int, dtype: torch.dtype
) -> tuple[cpu_qgemm.QuantizedWeight, torch.Tensor]:
    """Random blocks of the type, packed, and the same weight dequantized to ``dtype``."""
    size, per, halves = TYPES[type_name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off in halves:
        d = (rng.standard_normal((n, k // per, 1)) * 0.02).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(n, k // per, 2)
    ints = split_blocks(raw, type_name, n, k)
    assert ints is not None
    dense = ints.scale.repeat(32, axis=1) * ints.q.astype(np.float32)
    if ints.minimum is not None:
        dense = dense + ints.minimum.repeat(32, axis=1)
    packed = cpu_qgemm.QuantizedWeight.pack(ints.q, ints.scale, ints.minimum)
    return packed, torch.from_numpy(dense).to(dtype)


def gemm_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    cases = [(t, s) for s in args.shapes.split(",") for t in TYPES]
    cases = [(t, s) for t, s in cases if int(s.split("x")[1]) % TYPES[t][1] == 0]  # whole blocks
    for type_name, shape in progress_iter(cases, "gemm cases"):
        n, k = (int(v) for v in shape.split("x"))
        packed, dense = random_weight(type_name, n, k, args.dtype)
        quant, plain = cpu_qgemm.QuantizedLinear(packed), cpu_gemm.PackedLinear(dense, None)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(args.dtype)
            calls = max(1, int(args.budget_ms / max(0.01, n * k * m * 2 / 20e9 * 1e3)))
            q_ms, d_ms = [], []
            for _ in range(args.repeat):  # interleaved: both see the same load
                q_ms.append(per_call_ms(lambda x=x, f=quant: f(x), calls, runs=1))
                d_ms.append(per_call_ms(lambda x=x, f=plain: f(x), calls, runs=1))
            q, d = statistics.median(q_ms), statistics.median(d_ms)
            row = {
                "type": type_name, "n": n, "k": k, "m": m,
                "quant_ms": round(q, 4), "dense_ms": round(d, 4),
                "quant_gb_s": round(packed.nbytes / q / 1e6, 2),
                "dense_gb_s": round(n * k * dense.element_size() / d / 1e6, 2),
                "ratio": round(d / q, 2),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{type_name:>5} {n}x{k} M={m:<5d} quantized {q:9.3f} ms "
                f"({row['quant_gb_s']:6.1f} GB/s), dense {d:9.3f} ms "
                f"({row['dense_gb_s']:6.1f} GB/s), dense/quantized {d / q:5.2f}x"
            )
    return rows


def decode_tok_s(engine: LLMEngine, prompt: list[int], tokens: int, tag: str) -> float:
    """Tokens a second after the first (the prefill's) until the request finishes."""
    engine.add_request(
        EngineRequest(tag, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    )
    first, counted, produced = 0.0, 0, 0
    while engine.has_unfinished:
        for out in engine.step():
            produced += len(out.new_token_ids)
        if not counted and produced:
            first, counted = time.perf_counter(), produced
    return (produced - counted) / (time.perf_counter() - first)


def decode_rows(args: argparse.Namespace) -> dict[str, object]:
    engines = {
        mode: LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=str(args.dtype).removeprefix("torch."),
                device="cpu",
                gguf_weights=mode,
                max_model_len=args.prompt + args.decode_tokens + 16,
            )
        )
        for mode in ("quantized", "dequantized")
    }
    prompt = engines["quantized"].tokenizer.encode(
        "Write a short story about a lighthouse keeper. " * (args.prompt // 10 + 1)
    )[: args.prompt]
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    for r in progress_iter(range(args.rounds), "decode rounds"):
        for mode, engine in engines.items():
            engine.evict_all()
            rates[mode].append(decode_tok_s(engine, prompt, args.decode_tokens, f"{mode}{r}"))
    q, d = statistics.median(rates["quantized"]), statistics.median(rates["dequantized"])
    weights = quantized_bytes(engines["quantized"].runner.model)
    print(
        f"decode, 1 stream, {args.decode_tokens} tokens after a {len(prompt)}-token prompt: "
        f"quantized {q:.1f} tok/s ({weights / 2**20:.0f} MiB quantized weights), dequantized "
        f"{d:.1f} tok/s, {q / d:.2f}x"
    )
    return {"quantized_tok_s": round(q, 2), "dequantized_tok_s": round(d, 2), "ratio": q / d}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3072x576,49152x576", help="n x k, comma-separated")
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=50.0, help="time per timed run, about")
    ap.add_argument("--model", default="smollm2", help="a GGUF file or a named GGUF model")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_qgemm.computes(torch.bfloat16) else "float32"
    args.dtype = getattr(torch, args.dtype)
    result: dict[str, object] = {"cpu": cpu_model_name(), "available": cpu_qgemm.available()}
    result["threads"] = torch.get_num_threads()
    result["dtype"] = str(args.dtype).removeprefix("torch.")
    if not cpu_qgemm.computes(args.dtype) or not cpu_gemm.available():
        why = cpu_qgemm.dtype_reason(args.dtype) or "the dense GEMM does not load"
        print(f"the CPU GEMM kernels do not run {result['dtype']} here ({why}): nothing to compare")
    else:
        print(f"CPU: {result['cpu']}, {result['threads']} threads, {result['dtype']}")
        result["gemm"] = gemm_rows(args)
        result["decode"] = decode_rows(args)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
