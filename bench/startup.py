"""Server start: seconds from ``prefixcache serve`` to ``/health`` answering 200 (weights,
tokenizer, KV pools, kernels loaded) and to the first completion's answer, over several fresh
processes (min / median / max), and the server's resident memory then (its process and
children, MiB); with ``--peer``, a second server measured the same way and the ratios of the
medians (ours over the peer's).

    .venv/bin/python bench/startup.py [--model smollm2] [--runs 3] [--json]
    .venv/bin/python bench/startup.py --model gemma3 \\
        --peer "/root/vllm-venv/bin/vllm serve /root/gemma3-270m-hf --port {port}" \\
        --peer-model /root/gemma3-270m-hf

The first run also pays what later starts find cached (``$PREFIXCACHE_HOME``: the named
model's file, the GGUF index, compiled kernels); ``--runs`` beyond one shows the warm start.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

from serving import free_port, stop_server
from soak import rss_mib

from prefixcache.engine.kernels.cpu_features import cpu_model_name
from prefixcache.engine.model.progress import progress_bar

POLL_S = 0.05
DEADLINE_S = 600.0


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused while the process starts, 503 while the model loads
        return False


def first_completion(base: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 1})
    request = urllib.request.Request(
        base + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        json.loads(reply.read())


def one_start(cmd: list[str], port: int, model: str) -> dict[str, float]:
    """Seconds from spawning ``cmd`` to a healthy server, and to its first answer."""
    base = f"http://127.0.0.1:{port}"
    if healthy(base):
        raise SystemExit(f"a server already answers on port {port}")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not healthy(base):
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited: {proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
            if time.perf_counter() - start > DEADLINE_S:
                raise SystemExit(f"{shlex.join(cmd)}: not healthy in {DEADLINE_S:.0f} s")
            time.sleep(POLL_S)
        ready = time.perf_counter() - start
        first_completion(base, model)
        first = time.perf_counter() - start
        return {"ready_s": ready, "first_token_s": first, "rss_mib": rss_mib(proc.pid)}
    finally:
        stop_server(proc)


def spread(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


def timed(label: str, make_cmd: Callable[[int], list[str]], model: str, runs: int) -> dict:
    results = []
    bar = progress_bar(f"{label}: server starts", runs, unit="start")
    for _ in range(runs):
        port = free_port()
        results.append(one_start(make_cmd(port), port, model))
        bar.update(1)
    bar.close()
    return {k: spread(results, k) for k in ("ready_s", "first_token_s", "rss_mib")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="more `prefixcache serve` flags")
    parser.add_argument("--peer", help="a peer server's command, {port} where its port goes")
    parser.add_argument("--peer-model", help="the model name the peer answers to")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def ours(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--model", args.model]
        return [*cmd, "--port", str(port), *shlex.split(args.serve_args)]

    result: dict = {"cpu": cpu_model_name(), "model": args.model, "runs": args.runs}
    result["ours"] = timed("prefixcache", ours, args.model, args.runs)
    if args.peer:
        peer_model = args.peer_model or args.model

        def peer(port: int) -> list[str]:
            return shlex.split(args.peer.format(port=port))

        result["peer"] = timed("peer", peer, peer_model, args.runs)
        result["peer_command"] = args.peer
        for key in ("ready_s", "first_token_s", "rss_mib"):
            ratio = result["ours"][key]["median"] / result["peer"][key]["median"]
            result[f"{key.removesuffix('_s')}_vs_peer"] = round(ratio, 3)
    for who in ("ours", "peer"):
        if who in result:
            r, f = result[who]["ready_s"], result[who]["first_token_s"]
            print(
                f"{who}: healthy after {r['median']} s (min {r['min']}, max {r['max']}), "
                f"first answer after {f['median']} s, resident {result[who]['rss_mib']['median']} MiB",
                file=sys.stderr if args.json else sys.stdout,
            )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
