"""The LM head of a GGUF model at bf16: the integer kernel (``$PREFIXCACHE_INT8_HEAD=1``,
``kernels/cpu_head_int8.cpp``) against the default one on the same Q8_0 blocks (AMX: each
weight turned into its bf16 value inside the kernel; elsewhere the bf16 panels).

- ``rows``: for each row count (1 is a lone stream's decode step and every first token; a
  batch of N streams decodes N rows), the median ms of a head call, alternated between the
  two heads, and the default's time over the integer one's (above 1: the integer head wins).
- ``accuracy``: logits of real hidden states (the model's own final norm over a prompt)
  against float64 on the exact dequantized weights: mean and max absolute error of each head,
  and how often each one's argmax is the exact one's.
- ``decode``: an engine per head, N streams of 64 new tokens after a 64-token prompt: ms a
  decode step and tokens per second, and the ratio.

    .venv/bin/python bench/lm_head.py [--model gemma3] [--rows 1 4 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import gguf
import numpy as np
import torch

from prefixcache.engine import settings
from prefixcache.engine.config import EngineConfig
from prefixcache.engine.engine import LLMEngine
from prefixcache.engine.kernels import cpu_head_int8
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.loader import LoadedModel, load_model
from prefixcache.engine.model.named_models import NAMED_MODELS, ensure_named_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.request import EngineRequest, SamplingParams


def load(model: str, integer: bool) -> LoadedModel:
    """The model at bf16 with the integer head or without (the setting is read at load)."""
    os.environ[settings.INT8_HEAD_ENV] = "1" if integer else "0"
    try:  # read at load (the blocks kept) and at prepare (the kernel chosen)
        loaded = load_model(model, dtype="bfloat16", device="cpu")
        loaded.model.prepare()
    finally:
        del os.environ[settings.INT8_HEAD_ENV]
    return loaded


def kernel(loaded: LoadedModel) -> str:
    invariant = getattr(loaded.model.head, "invariant", None)
    return getattr(invariant, "kernel", type(loaded.model.head).__name__)


def rows_figure(heads: dict[str, LoadedModel], counts: list[int], seconds: float) -> list[dict]:
    out = []
    hidden = next(iter(heads.values())).config.hidden_size
    for m in progress_iter(counts, "row counts"):
        x = torch.randn(m, hidden).to(torch.bfloat16)
        for loaded in heads.values():  # first-call costs
            loaded.model.compute_logits(x)
        times: dict[str, list[float]] = {name: [] for name in heads}
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or min(len(t) for t in times.values()) < 3:
            for name, loaded in heads.items():
                start = time.perf_counter()
                loaded.model.compute_logits(x)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        out.append(
            {
                "rows": m,
                "integer_ms": round(ms["integer"], 2),
                "default_ms": round(ms["default"], 2),
                "default_over_integer": round(ms["default"] / ms["integer"], 2),
            }
        )
    return out


def final_hidden(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The head's input over ``ids`` (plain causal attention: a prompt within the window)."""
    groups, scale = loaded.config.num_queries_per_kv, loaded.config.attention_scale

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
        )
        return out.transpose(0, 1)

    with torch.no_grad():
        return loaded.model(torch.tensor(ids), torch.arange(len(ids)), attend)


def exact_head(path: str) -> torch.Tensor:
    """The GGUF's output (or tied embedding) weight dequantized exactly (float32 holds q * d)."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight", tensors["token_embd.weight"])
    return torch.from_numpy(np.asarray(gguf.dequantize(t.data, t.tensor_type)))


def accuracy_figure(heads: dict[str, LoadedModel], path: str, length: int) -> dict:
    loaded = heads["default"]
    rng = random.Random(0)
    ids = [rng.randrange(10, loaded.config.vocab_size) for _ in range(length)]
    x = final_hidden(loaded, ids).to(torch.bfloat16)
    w = exact_head(path)
    exact = torch.cat([x[i : i + 64].double() @ w.double().T for i in range(0, len(x), 64)])
    out: dict = {"rows": len(x)}
    for name, model in heads.items():
        err = (model.model.head(x).double() - exact).abs()
        same = (model.model.head(x).argmax(dim=1) == exact.argmax(dim=1)).float().mean()
        out[name] = {
            "mean_abs_err": float(f"{err.mean().item():.3g}"),
            "max_abs_err": float(f"{err.max().item():.3g}"),
            "argmax_as_exact": round(same.item(), 4),
        }
    out["mean_err_ratio"] = round(
        out["default"]["mean_abs_err"] / max(out["integer"]["mean_abs_err"], 1e-30), 1
    )
    return out


def decode_figure(model: str, batches: list[int], new_tokens: int) -> list[dict]:
    rows = []
    for integer in (False, True):
        loaded = load(model, integer)
        engine = LLMEngine(
            EngineConfig(model=model, dtype="bfloat16", device="cpu", num_blocks=2048), loaded
        )
        rng = random.Random(1)
        vocab = loaded.config.vocab_size
        engine.generate(
            [[rng.randrange(10, vocab) for _ in range(64)]], SamplingParams(max_tokens=4)
        )
        for n in batches:
            reqs = [
                EngineRequest(
                    f"{integer}-{n}-{i}",
                    [rng.randrange(10, vocab) for _ in range(64)],
                    SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True),
                )
                for i in range(n)
            ]
            start = time.perf_counter()
            engine.generate(reqs)
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "head": "integer" if integer else "default",
                    "streams": n,
                    "step_ms": round(seconds / (new_tokens + 1) * 1e3, 1),
                    "tokens_per_s": round(n * new_tokens / seconds, 1),
                }
            )
        engine.close()
        del engine, loaded
    default = {r["streams"]: r for r in rows if r["head"] == "default"}
    for r in rows:
        if r["head"] == "integer":
            r["speedup"] = round(default[r["streams"]]["step_ms"] / r["step_ms"], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3", help="a named GGUF model or a .gguf file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=1.0, help="per row count")
    parser.add_argument("--accuracy-rows", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not cpu_head_int8.available():  # measured nothing: say so (AVX512_VNNI needed)
        print(
            json.dumps(
                {"available": False, "cpu": cpu_model_name(), "threads": torch.get_num_threads()}
            )
        )
        return
    path = str(ensure_named_model(args.model)) if args.model in NAMED_MODELS else args.model
    heads = {"default": load(args.model, False), "integer": load(args.model, True)}
    if kernel(heads["integer"]) != "q8_int":
        raise SystemExit(f"{args.model}'s head does not take the integer kernel (not Q8_0?)")
    report = {
        "available": True,
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "model": args.model,
        "kernels": {name: kernel(loaded) for name, loaded in heads.items()},
        "rows": rows_figure(heads, args.rows, args.seconds),
        "accuracy": accuracy_figure(heads, path, args.accuracy_rows),
    }
    del heads
    report["decode"] = decode_figure(args.model, args.batches, args.new_tokens)
    if not args.json:
        print(f"{report['cpu']}, {report['threads']} threads, {args.model}: {report['kernels']}")
        for r in report["rows"]:
            print(
                f"{r['rows']:>5} rows: integer {r['integer_ms']:.2f} ms, default "
                f"{r['default_ms']:.2f} ms: {r['default_over_integer']}x"
            )
        acc = report["accuracy"]
        for name in ("default", "integer"):
            a = acc[name]
            print(
                f"{name}: |err| mean {a['mean_abs_err']}, max {a['max_abs_err']}, "
                f"argmax as exact {a['argmax_as_exact']}"
            )
        for r in report["decode"]:
            print(
                f"decode, {r['head']}, {r['streams']} streams: {r['step_ms']} ms a step, "
                f"{r['tokens_per_s']} tok/s" + (f" ({r['speedup']}x)" if "speedup" in r else "")
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
