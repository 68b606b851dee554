"""Every layer GEMM of a model, one pass at M rows, as a step meets them (weights from L3 or
memory: the pass reads all of them before the first comes round again).

For each ``--rows`` M: the median time of a pass over every layer's QKV, output, gate/up and
down projections (the prepared model's own ``Gemm``s, the engine's default kernel), its
TFLOP/s, and the ratio of that rate to the rate at ``--full-rows`` (2,048: a cold prefill
chunk). At few rows each weight panel serves few row tiles, so the rate falls; a warm suffix
(64 rows) is where the hybrid bench's efficiency is decided. Then the LM head at each row
count up to 64, as loaded (a GGUF head's Q8_0 blocks for a few rows without AMX), against
the bf16 packing of its weight (``head_ms``). Where the
layers read their GGUF blocks (a dequantized bf16 GGUF model on AMX), the same pass on the
blocks against the bf16 panels of the same weights, alternated, a 400 MB sweep before each
(``blocks_vs_panels``: the same bits, fewer bytes).

    .venv/bin/python bench/layer_gemms.py [--model gemma3] [--rows 1 16 64 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prefixcache.engine.kernels import cpu_gemm
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_iter


def pass_ms(model: torch.nn.Module, rows: int, seconds: float) -> tuple[float, int]:
    """Median ms of one pass at ``rows`` rows over ``seconds``; the pass's multiply-adds."""
    layers = list(model.model.layers)
    attn, mlp = layers[0].self_attn, layers[0].mlp
    widths = {
        "qkv": attn.num_heads * attn.head_dim,  # the output projection's input
        "hidden": model.config.hidden_size,
        "inter": mlp.intermediate_size,
    }
    x = {k: torch.randn(rows, w).to(model.model.norm.weight.dtype) for k, w in widths.items()}
    calls = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        calls += [(a.qkv, x["hidden"]), (a.out, x["qkv"]), (m.gate_up, x["hidden"])]
        calls.append((m.down, x["inter"]))
    macs = sum(
        p.numel()
        for name, p in model.model.layers.named_parameters()
        if name.endswith("_proj.weight")
    )
    for fn, arg in calls:  # first-call costs
        fn(arg)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        for fn, arg in calls:
            fn(arg)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, macs * rows


def _layer_calls(model: torch.nn.Module) -> list[cpu_gemm.PackedLinear]:
    return [
        proj.invariant
        for layer in model.model.layers
        for proj in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down)
    ]


def _panels(model: torch.nn.Module) -> list[cpu_gemm.PackedLinear]:
    """The layer projections' bf16 panels, packed from the same (fused) weights (before
    ``prepare()``)."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
        qkv_bias = None if biases[0] is None else torch.cat(biases)
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
        out += [cpu_gemm.PackedLinear(qkv, qkv_bias), cpu_gemm.PackedLinear(a.o_proj.weight, None)]
        out += [
            cpu_gemm.PackedLinear(gate_up, None),
            cpu_gemm.PackedLinear(m.down_proj.weight, None),
        ]
    return out


def blocks_vs_panels(
    calls: list[cpu_gemm.PackedLinear],
    panels: list[cpu_gemm.PackedLinear],
    rows: int,
    seconds: float,
) -> dict[str, float]:
    """Median ms of a pass over every layer projection at ``rows`` rows, as loaded (blocks)
    and on bf16 panels, alternated, a 400 MB sweep before each pass."""
    xs = [torch.randn(rows, c.in_features).to(torch.bfloat16) for c in calls]
    sweep = torch.empty(100_000_000, dtype=torch.float32)
    times: dict[str, list[float]] = {"blocks": [], "panels": []}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times["blocks"]) < 3:
        for name, fns in (("blocks", calls), ("panels", panels)):
            sweep.add_(1.0)
            start = time.perf_counter()
            for fn, x in zip(fns, xs, strict=True):
                fn(x)
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"rows": rows, "blocks_ms": round(ms["blocks"], 2), "panels_ms": round(ms["panels"], 2),
            "ratio": round(ms["blocks"] / ms["panels"], 3)}  # fmt: skip


def head_ms(model: torch.nn.Module, rows: int, seconds: float) -> dict[str, float | str]:
    """The prepared LM head (its kernel as loaded: ``q8_amx`` reads a GGUF head's Q8_0 blocks,
    as ``q8`` does up to ``cpu_gemm.FEW_ROWS`` rows without AMX)
    against the bf16 packing of the same weight, alternated, after a 400 MB sweep each call
    (as a step meets it: the layers' weights went through the caches in between)."""
    head = model.head.invariant
    weight = model.lm_head.weight  # a tied one lives only in the head's packing once prepared
    if weight.device.type == "meta":
        weight = head.weight_rows(torch.arange(head.out_features))
    baseline = cpu_gemm.PackedLinear(weight, None, float_out=True)
    x = torch.randn(rows, model.config.hidden_size).to(baseline.dtype)
    sweep = torch.empty(100_000_000, dtype=torch.float32)
    times: dict[str, list[float]] = {"head": [], "bf16": []}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times["head"]) < 3:
        for name, fn in (("head", head), ("bf16", baseline)):
            sweep.add_(1.0)
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    kernel = head.kernel  # blocks beside the panels (AVX-512): read up to FEW_ROWS rows
    if getattr(head, "few_rows_kernel", None):
        kernel = f"{head.few_rows_kernel} to {head.few_rows} rows, then {head.kernel}"
    return {"kernel": kernel, "ms": round(ms["head"], 2), "bf16_ms": round(ms["bf16"], 2),
            "ratio": round(ms["head"] / ms["bf16"], 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--full-rows", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=5.0, help="per row count")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    model = loaded.model
    # packed before prepare(), which frees the layer weights the kernels packed
    has_blocks = any(hasattr(m, "block_source") for m in model.model.layers.modules())
    panels = _panels(model) if has_blocks else None
    model.prepare()
    full_ms, full_macs = pass_ms(model, args.full_rows, args.seconds)
    full_rate = 2 * full_macs / full_ms / 1e9
    rows = []
    for m in progress_iter(args.rows, "row counts"):
        ms, macs = pass_ms(model, m, args.seconds)
        rate = 2 * macs / ms / 1e9
        rows.append({"rows": m, "ms": round(ms, 2), "tflops": round(rate, 3)})
        rows[-1]["rate_vs_full"] = round(rate / full_rate, 3)
        print(
            f"{m:5d} rows: {ms:8.2f} ms a pass, {rate:6.3f} TFLOP/s, "
            f"{rate / full_rate:.3f}x the rate at {args.full_rows} rows"
        )
    print(f"{args.full_rows:5d} rows: {full_ms:8.2f} ms a pass, {full_rate:6.3f} TFLOP/s")
    blocks = []
    calls = _layer_calls(model)
    kinds = sorted({c.kernel for c in calls})
    if panels is not None:
        for m in args.rows:
            blocks.append(blocks_vs_panels(calls, panels, m, args.seconds))
            b = blocks[-1]
            print(
                f"layers from their GGUF blocks ({'/'.join(kinds)}), {m:5d} rows: "
                f"{b['blocks_ms']:7.2f} ms against the bf16 panels' {b['panels_ms']:7.2f}: "
                f"{b['ratio']:.3f}x"
            )
    heads = []
    for m in args.rows:
        if m <= 64 and getattr(model.head, "invariant", None) is not None:
            heads.append({"rows": m, **head_ms(model, m, args.seconds)})
            h = heads[-1]
            print(
                f"LM head ({h['kernel']}), {m:3d} rows: {h['ms']:6.2f} ms against the bf16 "
                f"packing's {h['bf16_ms']:6.2f}: {h['ratio']:.3f}x"
            )
    if args.json:
        figures = {
            "cpu": cpu_model_name(),
            "model": args.model,
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "full": {"rows": args.full_rows, "ms": round(full_ms, 2), "tflops": full_rate},
            "rows": rows,
            "blocks_vs_panels": blocks,
            "head": heads,
        }
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
