"""The CLI: help text for every option, and `serve` as a real subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from prefixcache.sidecar.cli import build_parser

OPTIONS = [
    "--model",
    "--host",
    "--port",
    "--block-size",
    "--kv-memory-mib",
    "--max-batch-tokens",
    "--queue-limit",
    "--attention-backend",
    "--api-keys-file",
    "--max-body-mib",
]


def test_help_explains_every_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in OPTIONS:
        assert option in out
    top = subprocess.run(
        [sys.executable, "-m", "prefixcache.sidecar.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "serve" in top


def test_parser_maps_options() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "demo", "--port", "9001", "--block-size", "32", "--queue-limit", "7"]
    )
    assert (args.model, args.port, args.block_size, args.queue_limit) == ("demo", 9001, 32, 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "magic"])


@pytest.mark.slow
def test_serve_subprocess_answers_and_stops_on_sigint() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "prefixcache.sidecar.cli",
        "serve",
        "--model",
        "demo",
        "--port",
        str(port),
        "--num-blocks",
        "128",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
