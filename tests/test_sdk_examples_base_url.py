"""Every example that talks to a sidecar finds it where docs/sdk.md says: ``--base-url``,
else ``$PREFIXCACHE_BASE_URL``, else http://127.0.0.1:8000/v1. A stub server that answers
every request with a 400 records whether the example reached it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOWHERE = "http://127.0.0.1:9/v1"  # discard: refused at once
SCRIPTS = ["quickstart.py", "agent_loop.py", "chat_assistant.py", "rag_pipeline.py"]


class _Refuse(BaseHTTPRequestHandler):
    seen: list[str]

    def _answer(self) -> None:
        self.seen.append(self.path)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"error": {"message": "stub", "type": "invalid_request_error"}}'
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Handler", (_Refuse,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()
    server.server_close()


def _run(script: str, args: list[str], env_url: str) -> None:
    if script == "agent_loop.py" and importlib.util.find_spec("openai") is None:
        pytest.skip("agent_loop.py needs the openai client")
    env = {**os.environ, "PREFIXCACHE_BASE_URL": env_url}
    subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], env=env, capture_output=True, timeout=120
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_environment_names_the_server(script: str, stub: tuple[str, list[str]]) -> None:
    url, seen = stub
    _run(script, [], env_url=url)
    assert seen, f"{script} never reached $PREFIXCACHE_BASE_URL"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_flag_wins_over_the_environment(script: str, stub: tuple[str, list[str]]) -> None:
    url, seen = stub
    _run(script, ["--base-url", url], env_url=NOWHERE)
    assert seen, f"{script} never reached --base-url"
