"""The CLI: help text for every option, and `serve` as a real subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Server

from prefixcache.sidecar.cli import build_parser, read_secret, serve

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
    "--cache-dir",
    "--load-cache",
    "--upstream",
    "--load-factor",
    "--min-load",
    "--generation-config",
    "--upstream-api-key",
    "--upstream-timeout",
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


def test_load_cache_needs_a_cache_dir() -> None:
    with pytest.raises(SystemExit, match="--load-cache needs --cache-dir"):
        serve(build_parser().parse_args(["serve", "--load-cache", "pinned"]))


def test_one_tenant_keeps_its_namespace_across_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without keys the namespace secret is fixed, so loaded prefixes hit after a restart;
    with keys it is random per start unless --secret-file or $PREFIXCACHE_SECRET sets it."""
    monkeypatch.delenv("PREFIXCACHE_SECRET", raising=False)
    assert read_secret(None, keys_enabled=False) == read_secret(None, keys_enabled=False)
    assert read_secret(None, keys_enabled=True) != read_secret(None, keys_enabled=True)
    monkeypatch.setenv("PREFIXCACHE_SECRET", "from the environment")
    assert read_secret(None, keys_enabled=True) == b"from the environment"


@contextlib.contextmanager
def cli_server(*options: str, timeout: float = 120) -> Iterator[str]:
    """`prefixcache serve OPTIONS` as a subprocess on a free port: its root URL once healthy;
    stopped with SIGINT, which must exit 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen([*cmd, *options], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{root}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        yield root
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_serve_subprocess_answers_and_stops_on_sigint() -> None:
    options = ("--model", "demo", "--num-blocks", "128", "--log-level", "warning")
    with cli_server(*options) as root:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] >= 1


def test_serve_upstream_routes_to_another_server(fake_server: Server) -> None:
    """`prefixcache serve --upstream URL`: no engine here, the fake sidecar answers."""
    with cli_server("--upstream", fake_server.url, "--log-level", "warning", timeout=60) as root:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{root}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "fake"  # answered by the upstream
        metrics = httpx.get(f"{root}/metrics").text
        series = (
            f'prefixcache:upstream_requests_total{{route="affinity",upstream="{fake_server.url}"}}'
        )
        assert f"{series} 1.0" in metrics


@pytest.mark.parametrize("broken", ["missing", "bad-config"])
def test_a_model_that_cannot_load_ends_the_process(tmp_path: Path, broken: str) -> None:
    """No zombie server answering 503 forever: exit non-zero with the error on stderr."""
    model = tmp_path / "typo"
    if broken == "bad-config":
        model.mkdir()
        (model / "config.json").write_text("{not json")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--port", str(port)]
    proc = subprocess.run(
        [*cmd, "--model", str(model), "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=60,  # the old code never exited: TimeoutExpired
    )
    assert proc.returncode != 0
    assert "prefixcache serve: the engine failed to start" in proc.stderr
    if broken == "missing":
        assert model.name in proc.stderr
