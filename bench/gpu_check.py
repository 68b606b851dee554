"""The GPU check, one unattended run on a lent CUDA machine (an H200: torch 2.11 + CUDA 13 + nvcc,
no network): FlashInfer installed from the carried kit, the GPU tests, then timings.

1. Install the kit (``.fikit``, built here by ``bench/gpu_kit.sh``: flashinfer-python 0.7.2.post1
   with the kernel sources attention never compiles removed, apache-tvm-ffi, einops, msgspec)
   into /tmp/site; make ``prefixcache`` importable from the work tree (no install needed).
2. ``tests/test_flashinfer_gpu.py`` (FlashInfer backend vs torch backend and a dense reference
   in bf16: prefill, decode, cascade, sliding window, fixed-split invariance, the demo model).
   FlashInfer JIT-compiles each kernel on first use (nvcc; minutes, cached in
   $FLASHINFER_WORKSPACE_BASE for the timings after it).
3. The sliding window (``window_check``): a windowed step (a 256-token prefill chunk and
   decodes at a 4K context, window 512: FlashInfer's ``window_left`` = 511) against a dense
   masked reference per sequence, with the pages before every window mapped to a null page
   full of the largest finite bf16 (then full of NaN: ``reads_null_pages`` says whether
   FlashInfer's kernels read them at all, which the contract allows); and decode at 4K,
   window vs full.
4. Timings at batch 32 over an 8K shared prefix, demo model shape (8 query / 4 KV heads of 64):
   decode attention per layer (fixed split, FlashInfer's own split, cascade), the model's
   decode step plain vs cascade, and cold vs warm TTFT of an 8K+64-token prompt (model steps
   in 2048-token chunks, as the scheduler's default budget cuts them; no HTTP, no scheduler).

Whole run under 8 minutes (phases are skipped past the deadline, and say so); the last line is
JSON. Without CUDA it says so, prints ``{"skipped": true, ...}`` and exits 0. ``--cpu-standin``
runs step 3's code at small sizes over the tests' CPU stand-in (checks this script, not
FlashInfer; no timings worth reading).

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --kit .fikit      # on the device
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BS = 16
HQ, HK, D = 8, 4, 64  # the demo model's attention shape
CHUNK = 2048  # EngineConfig.max_num_batched_tokens' default
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[gpu_check {elapsed():6.1f}s] {msg}", flush=True)


def add_path(path: Path) -> None:
    sys.path.insert(0, str(path))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(path), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def install_kit(kit: Path, site: Path) -> dict[str, Any]:
    wheels = sorted(kit.glob("*.whl"))
    if not wheels:
        return {"ok": False, "reason": f"no wheels in {kit} (build it with bench/gpu_kit.sh)"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if proc.returncode:
        return {"ok": False, "reason": proc.stderr[-2000:]}
    add_path(site)
    return {"ok": True, "wheels": [w.name for w in wheels]}


def importable_project() -> None:
    """``prefixcache.*`` from the work tree: a namespace folder of links to its three layers."""
    try:
        import prefixcache.engine  # noqa: F401
    except ImportError:
        shim = Path(tempfile.gettempdir()) / "prefixcache-shim"
        (shim / "prefixcache").mkdir(parents=True, exist_ok=True)
        for name in ("engine", "sdk", "sidecar"):
            link = shim / "prefixcache" / name
            if not link.exists():
                link.symlink_to(ROOT / name)
        add_path(shim)


def run_gpu_tests(timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "--noconftest", "-p", "no:cacheprovider"]
    cmd += ["-o", "addopts=", "-o", "timeout=0", str(ROOT / "tests" / "test_flashinfer_gpu.py")]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT / "tests"
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:]
        return {"ok": False, "reason": f"timed out after {timeout:.0f} s", "tail": str(tail)}
    out = proc.stdout + proc.stderr
    print(out[-6000:], flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    return {"ok": proc.returncode == 0 and counts.get("passed", 0) > 0, "rc": proc.returncode,
            **counts}  # fmt: skip


class Timer:
    def __init__(self, device: torch.device, repeat: int) -> None:
        self.device, self.repeat = device, repeat

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Median seconds of ``fn`` after one warm-up call."""
        fn()
        self.sync()
        times = []
        for _ in range(self.repeat):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def shared_prefix_case(batch: int, prefix: int, suffix: int) -> list[Any]:
    from prefixcache.engine.attention import SeqSpec

    shared = list(range(prefix // BS))
    seqs, nxt = [], len(shared)
    for i in range(batch):
        own = -(-(prefix + suffix + i + 1) // BS) - len(shared)
        seqs.append(SeqSpec(prefix + suffix + i, 1, [*shared, *range(nxt, nxt + own)]))
        nxt += own
    return seqs


def attention_timings(
    make: Callable[..., Any], dev: torch.device, batch: int, prefix: int, timer: Timer
) -> dict[str, Any]:
    """Decode attention per layer: fixed split (the default), FlashInfer's split, cascade."""
    from prefixcache.engine.attention import AttentionMetadata, AttentionShape, plan_step_order

    seqs = shared_prefix_case(batch, prefix, 32)
    num_blocks = max(max(s.block_table) for s in seqs) + 1
    gen = torch.Generator(device=dev).manual_seed(0)
    layer = torch.randn(num_blocks, 2, BS, HK, D, device=dev, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, HK, D, device=dev, generator=gen).to(torch.bfloat16)
    shape = AttentionShape(HQ, HK, D, torch.bfloat16)
    result: dict[str, Any] = {}
    outs = {}
    for name, invariant, cascade in (
        ("fixed_split", True, False),
        ("flashinfer_split", False, False),
        ("cascade", False, True),
    ):
        order, groups = plan_step_order(seqs, BS, cascade)
        meta = AttentionMetadata.build([seqs[i] for i in order], BS, dev, groups)
        backend = make(batch_invariant=invariant)
        result[f"plan_{name}_ms"] = timer(lambda b=backend, m=meta: b.plan(m, shape)) * 1e3
        backend.plan(meta, shape)
        outs[name] = backend.forward(q, k, k, layer)
        result[f"{name}_us"] = timer(lambda b=backend: b.forward(q, k, k, layer)) * 1e6
    diff = max(float((outs[n].float() - outs["fixed_split"].float()).abs().max()) for n in outs)
    result["max_diff_vs_fixed_split"] = diff
    result["cascade_speedup"] = result["fixed_split_us"] / result["cascade_us"]
    return result


def window_check(
    make: Callable[..., Any], dev: torch.device, context: int, window: int, timer: Timer
) -> dict[str, Any]:
    """FlashInfer SWA vs a dense masked reference (see the module docstring, step 3)."""
    import math

    from prefixcache.engine.attention import AttentionMetadata, AttentionShape, SeqSpec

    gen = torch.Generator().manual_seed(2)
    spec = [(context - 256, 256), (context, 1), (context - 37, 1), (window // 2, 1)]
    pages = -(-(context + 1) // BS)
    layer = torch.zeros(1 + len(spec) * pages, 2, BS, HK, D, dtype=torch.bfloat16)
    seqs, full, qs, new = [], [], [], []
    nxt = 1  # page 0: the null page
    for start, n in spec:
        kv = torch.randn(start + n, 2, HK, D, generator=gen).bfloat16()
        skip = max(0, start - window + 1) // BS  # pages wholly before the first window
        own = -(-(start + n) // BS) - skip
        table = [0] * skip + list(range(nxt, nxt + own))
        nxt += own
        for pos in range(skip * BS, start):
            layer[table[pos // BS], :, pos % BS] = kv[pos]
        seqs.append(SeqSpec(start, n, table))
        full.append(kv)
        qs.append(torch.randn(n, HQ, D, generator=gen).bfloat16())
        new.append(kv[start:])
    meta = AttentionMetadata.build(seqs, BS, dev, window=window)
    shape = AttentionShape(HQ, HK, D, torch.bfloat16)
    q = torch.cat(qs).to(dev)
    k, v = (torch.cat([x[:, i] for x in new]).to(dev) for i in (0, 1))

    def run(fill: float) -> torch.Tensor:
        backend = make()
        backend.plan(meta, shape)
        pool = layer.to(dev, copy=True)
        pool[0] = fill
        return backend.forward(q, k, v, pool).float().cpu()

    out = run(torch.finfo(torch.bfloat16).max)
    err, row = 0.0, 0
    for (start, n), kv, qq in zip(spec, full, qs, strict=True):
        kf = kv[:, 0].double().repeat_interleave(HQ // HK, dim=1)
        vf = kv[:, 1].double().repeat_interleave(HQ // HK, dim=1)
        sc = torch.einsum("qhd,khd->hqk", qq.double(), kf) / math.sqrt(D)
        pos = torch.arange(start, start + n)[:, None]
        key = torch.arange(start + n)[None, :]
        sc = sc.masked_fill((key > pos) | (key <= pos - window), -math.inf)
        ref = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vf)
        err = max(err, float((out[row : row + n].double() - ref).abs().max()))
        row += n
    nan_out = run(math.nan)
    result: dict[str, Any] = {"context": context, "window": window, "max_abs_err": err}
    result["reads_null_pages"] = not torch.equal(nan_out, out)
    result["ok"] = err < 3e-2

    def decode_us(w: int) -> float:
        dseqs = [SeqSpec(context, 1, list(range(1 + i * pages, 1 + (i + 1) * pages))) for i in
                 range(len(spec))]  # fmt: skip
        dmeta = AttentionMetadata.build(dseqs, BS, dev, window=w)
        backend = make()
        backend.plan(dmeta, shape)
        pool = layer.to(dev, copy=True)
        dq, dk = q[: len(dseqs)], k[: len(dseqs)]
        return timer(lambda: backend.forward(dq, dk, dk, pool)) * 1e6

    result["decode_full_us"] = decode_us(0)
    result["decode_window_us"] = decode_us(window)
    result["window_over_full"] = result["decode_window_us"] / result["decode_full_us"]
    return result


def model_timings(
    make: Callable[..., Any], dev: torch.device, batch: int, prefix: int, timer: Timer
) -> dict[str, Any]:
    """The demo model's decode step (plain vs cascade) and cold vs warm TTFT."""
    from prefixcache.engine.memory.kv_cache import KVCache
    from prefixcache.engine.model.loader import load_model
    from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

    loaded = load_model("demo", dtype="bfloat16", device=str(dev))
    vocab = loaded.config.vocab_size
    seqs = shared_prefix_case(batch, prefix, 32)
    num_blocks = max(max(s.block_table) for s in seqs) + 1 + (prefix + 64) // BS + 2
    cache = KVCache(loaded.kv_cache_spec(BS), num_blocks=num_blocks)
    result: dict[str, Any] = {}
    for name, invariant, cascade in (("plain", True, False), ("cascade", False, True)):
        runner = ModelRunner(loaded, cache, make(batch_invariant=invariant), cascade)
        step = [BatchEntry([7], s.start_pos, list(s.block_table)) for s in seqs]
        result[f"decode_step_{name}_ms"] = timer(lambda r=runner, b=step: r.execute(b)) * 1e3
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (prefix + 64,), generator=gen).tolist()
    table = list(range(num_blocks - -(-(prefix + 64) // BS), num_blocks))
    runner = ModelRunner(loaded, cache, make(batch_invariant=True), True)

    def cold() -> None:
        for a in range(0, len(prompt), CHUNK):
            b = min(len(prompt), a + CHUNK)
            runner.execute([BatchEntry(prompt[a:b], a, table, compute_logits=b == len(prompt))])

    def warm() -> None:  # the prefix's pages are already there (cold ran first)
        runner.execute([BatchEntry(prompt[prefix:], prefix, table)])

    result["ttft_cold_ms"] = timer(cold) * 1e3
    result["ttft_warm_ms"] = timer(warm) * 1e3
    result["ttft_speedup"] = result["ttft_cold_ms"] / result["ttft_warm_ms"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kit", type=Path, default=ROOT / ".fikit", help="the carried kit folder")
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--cpu-standin", action="store_true", help="dry run over the CPU stand-in")
    args = ap.parse_args()
    report: dict[str, Any] = {"ok": False}
    if args.cpu_standin:
        importable_project()
        sys.path.insert(0, str(ROOT / "tests"))
        import flashinfer_standin

        from prefixcache.engine.attention.flashinfer_backend import FlashInferBackend

        def make_cpu(**kw: Any) -> Any:
            return FlashInferBackend("cpu", module=flashinfer_standin, workspace_bytes=16, **kw)

        dev, timer = torch.device("cpu"), Timer(torch.device("cpu"), 1)
        report["attention"] = attention_timings(make_cpu, dev, 4, 256, timer)
        report["window"] = window_check(make_cpu, dev, 400, 64, timer)
        report["model"] = model_timings(make_cpu, dev, 4, 256, timer)
        report.update(ok=True, standin=True, elapsed_s=elapsed())
        print(json.dumps(report))
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; nothing to check (FlashInfer runs on CUDA).")
        print(json.dumps({"skipped": True, "reason": "cuda not available"}))
        return 0
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{major}.{minor}")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-ws")
    report.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    try:
        import flashinfer
    except ImportError:
        report["kit"] = install_kit(args.kit, args.site)
        log(f"kit: {report['kit']}")
        if not report["kit"]["ok"]:
            print(json.dumps(report))
            return 1
    importable_project()
    import flashinfer

    from prefixcache.engine.attention.flashinfer_backend import FlashInferBackend

    report["flashinfer"] = flashinfer.__version__
    log(f"flashinfer {flashinfer.__version__} on {report['device']}")
    budget = args.deadline - elapsed()
    if not args.skip_tests:
        report["tests"] = run_gpu_tests(max(30.0, min(330.0, budget - 120)))
        log(f"tests: {report['tests']}")
    dev, timer = torch.device("cuda"), Timer(torch.device("cuda"), args.repeat)

    def make(**kw: Any) -> Any:
        return FlashInferBackend("cuda", **kw)

    phases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("window", lambda: window_check(make, dev, 4096, 512, timer)),
        ("attention", lambda: attention_timings(make, dev, args.batch, args.prefix, timer)),
        ("model", lambda: model_timings(make, dev, args.batch, args.prefix, timer)),
    ]
    for name, fn in phases:
        if elapsed() > args.deadline - 45:
            report[name] = {"skipped": f"past the deadline ({elapsed():.0f} s)"}
            continue
        try:
            report[name] = fn()
        except Exception as e:  # report it and go on: the JSON line must come out
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        log(f"{name}: {report[name]}")
    timed = all("error" not in report.get(n, {}) for n in ("attention", "model"))
    window_ok = report["window"].get("ok", "skipped" in report["window"])
    report["ok"] = bool(report.get("tests", {"ok": True})["ok"]) and timed and window_ok
    report["elapsed_s"] = elapsed()
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
