"""The AMX GEMM kernel (``kernels/cpu_gemm_amx.cpp``) against another source of it, alternated
in one process: the way to time a kernel change on a box whose speed drifts by minutes.

The other source (``--against REV``, a git revision: HEAD by default, so an uncommitted edit
is timed against the last commit; or ``--old-source FILE``) is built as a second library, and
its entry points are swapped into the loaded model's AMX GEMMs call by call. Each repetition
times both, in alternating order, after one untimed call each. Reported per row count, as the
median ms of each and ``new_over_old`` (below 1: the working tree's kernel is faster):

- ``layers``: one pass over every layer projection (``bench/layer_gemms.py``'s calls);
- ``head``: the LM head's call;
- ``decode``: a ``ModelRunner`` decode step of N streams (one token each, after a prompt).

    .venv/bin/python bench/kernel_ab.py [--model gemma3] [--against HEAD~1]
        [--layers 1 16 64] [--head 1 4] [--decode 1 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from layer_gemms import _layer_calls  # bench/, the script's folder

from prefixcache.engine.attention import create_backend
from prefixcache.engine.kernels import cpu_gemm, cpu_library
from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.memory.kv_cache import KVCache
from prefixcache.engine.model.loader import load_model
from prefixcache.engine.model.progress import progress_iter
from prefixcache.engine.step.model_runner import BatchEntry, ModelRunner

REPO = Path(__file__).resolve().parent.parent
KERNELS = "engine/kernels"


def old_library(folder: Path, against: str | None, old_source: Path | None):
    """The other kernel source and its header, built as a library of its own."""
    source, header = folder / "cpu_gemm_amx.cpp", folder / "cpu_amx.h"
    if old_source is not None:
        source.write_bytes(old_source.read_bytes())
        header.write_bytes(cpu_library.AMX_HEADER.read_bytes())
    else:
        for path in (source, header):
            shown = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{against}:{KERNELS}/{path.name}"],
                capture_output=True,
                check=True,
            )
            path.write_bytes(shown.stdout)
    lib = cpu_library.CpuLibrary(
        source, "CPU GEMM on AMX (the other source)", "nothing", cpu_gemm._declare_amx, (header,)
    ).load()
    if lib is None or lib.pc_amx_enable() != 0:
        raise SystemExit("the other source does not build or AMX is not granted")
    return lib


def alternated(
    calls: list[cpu_gemm.PackedLinear], old_lib, run: Callable[[], None], reps: int
) -> tuple[float, float]:
    """Median ms of ``run`` with ``calls`` on the other library's entry points, and on their
    own."""
    new_fns = [c._fn for c in calls]
    old_fns = [getattr(old_lib, f.__name__) for f in new_fns]
    times: dict[str, list[float]] = {"old": [], "new": []}
    for rep in range(reps):
        order = ("old", "new") if rep % 2 else ("new", "old")
        for name in order:
            for c, f in zip(calls, old_fns if name == "old" else new_fns, strict=True):
                c._fn = f
            run()
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    for c, f in zip(calls, new_fns, strict=True):
        c._fn = f
    return statistics.median(times["old"]), statistics.median(times["new"])


def row(label: str, key: str, n: int, old_ms: float, new_ms: float) -> dict:
    print(f"  {label} {n}: old {old_ms:.2f} ms, new {new_ms:.2f} ms, new/old {new_ms / old_ms:.3f}")
    return {key: n, "old_ms": round(old_ms, 3), "new_ms": round(new_ms, 3),
            "new_over_old": round(new_ms / old_ms, 3)}  # fmt: skip


def decode_runner(loaded, streams: int, context: int):
    """A runner whose ``streams`` sequences each hold a ``context``-token prompt, and the step
    that decodes one token for each."""
    per = context // 16 + 2
    runner = ModelRunner(
        loaded, KVCache(loaded.kv_cache_spec(16), streams * per + 2), create_backend("auto", "cpu")
    )
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(streams)]
    for table in tables:
        prompt = torch.randint(10, loaded.config.vocab_size, (context,), generator=gen).tolist()
        runner.execute([BatchEntry(prompt, 0, table, compute_logits=True)])

    def step() -> None:
        runner.execute([BatchEntry([5], context, t, compute_logits=True) for t in tables])

    return runner, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--against", default="HEAD", help="git revision of the other source")
    ap.add_argument("--old-source", type=Path, help="the other source as a file instead")
    ap.add_argument("--layers", type=int, nargs="*", default=[1, 16, 64], help="row counts")
    ap.add_argument("--head", type=int, nargs="*", default=[1, 4], help="row counts")
    ap.add_argument("--decode", type=int, nargs="*", default=[1, 4], help="stream counts")
    ap.add_argument("--context", type=int, default=128, help="decode: each stream's prompt")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    if cpu_gemm._amx_lib() is None:
        out = {"available": False, "cpu": cpu_model_name(), "threads": torch.get_num_threads()}
        print(json.dumps(out))
        return
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        old_lib = old_library(Path(tmp), args.against, args.old_source)
    loaded = load_model(args.model, dtype="bfloat16", device="cpu")
    loaded.model.prepare()
    layer_calls = [c for c in _layer_calls(loaded.model) if c.kernel.endswith("amx")]
    head = loaded.model.head.invariant
    head_calls = [head] if head is not None and head.kernel.endswith("amx") else []
    print(f"{cpu_model_name()}, {torch.get_num_threads()} threads, {args.model}: "
          f"{len(layer_calls)} layer GEMMs and {len(head_calls)} head on AMX")  # fmt: skip
    work = [("layers", n) for n in args.layers if layer_calls]
    work += [("head", n) for n in args.head if head_calls]
    work += [("decode", n) for n in args.decode if layer_calls]
    result: dict = {"cpu": cpu_model_name(), "threads": torch.get_num_threads(),
                    "model": args.model, "against": str(args.old_source or args.against),
                    "layers": [], "head": [], "decode": []}  # fmt: skip
    for what, n in progress_iter(work, "alternated", unit="case"):
        if what == "decode":
            calls = layer_calls + head_calls
            runner, step = decode_runner(loaded, n, args.context)
            result[what].append(
                row("decode streams", "streams", n, *alternated(calls, old_lib, step, args.reps))
            )
            del runner
            continue
        calls = layer_calls if what == "layers" else head_calls
        xs = [torch.randn(n, c.in_features).to(torch.bfloat16) for c in calls]

        def run(calls=calls, xs=xs) -> None:
            for c, x in zip(calls, xs, strict=True):
                c(x)

        result[what].append(
            row(f"{what} rows", "rows", n, *alternated(calls, old_lib, run, args.reps))
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
