"""Shared fixtures: real uvicorn servers on free loopback ports, one event loop thread.

All servers of the session run on one background event loop, so that two apps can share one
AsyncEngine (the engine delivers outputs to the loop it was started on).

- ``sidecar_url``: the demo model, prefix caching on, no API keys. "http://127.0.0.1:PORT/v1".
- ``tenant_server``: a second app over the same engine, with an API keys file.
- ``nocache_server``: another engine on the same weights, caching off, one running sequence
  and a waiting limit of 2 (for greedy-equality and 429 tests).
- ``fake_server``: the app over tests/sidecar_fake_engine.py (records what reached it).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from prefixcache.sidecar.http.tenancy import KeyStore
from prefixcache.sidecar.http.uvicorn_protocol import HalfCloseHTTPProtocol
from prefixcache.sidecar.server.app import SidecarSettings, create_app

TEST_NUM_BLOCKS = 512  # 8192 token slots at block size 16: room for 50 concurrent streams
TEST_MAX_MODEL_LEN = 1024

KEYS = {
    "admin": {"key": "sk-test-admin-0001", "tenant": "acme", "admin": True},
    "a": {"key": "sk-test-tenant-a-01", "tenant": "tenant-a", "admin": False},
    "b": {"key": "sk-test-tenant-b-01", "tenant": "tenant-b", "admin": False},
}


class ServerLoop:
    """An event loop on a daemon thread that runs uvicorn servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Server:
    url: str  # base URL ending in /v1
    root: str  # base URL without /v1
    app: Any
    server: uvicorn.Server
    done: Future

    def stop(self) -> None:
        self.server.should_exit = True
        self.done.result(timeout=20)


def serve(loop: ServerLoop, app: Any, ready_timeout: float = 180, health: bool = True) -> Server:
    """Serve ``app`` on a free 127.0.0.1 port and wait until /health answers 200 (without
    ``health``: until it listens; route mode's /health asks its upstreams, a test's business)."""
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets of a TCP-proto
    # listener; without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        access_log=False,
        http=HalfCloseHTTPProtocol,  # as `prefixcache serve`
    )
    server = uvicorn.Server(config)
    done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while True:
        if done.done():
            done.result()  # raises the start-up error
            raise RuntimeError("uvicorn exited during start-up")
        if not health:
            if server.started:
                break
        else:
            try:
                if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"sidecar on {root} not healthy after {ready_timeout}s")
        time.sleep(0.05)
    return Server(f"{root}/v1", root, app, server, done)


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def demo_loaded() -> Any:
    from prefixcache.engine.model.loader import load_model

    return load_model("demo", dtype="float32", device="cpu")


def demo_engine(loaded: Any, **overrides: Any) -> Any:
    from prefixcache.engine.config import EngineConfig
    from prefixcache.engine.serving.async_engine import AsyncEngine

    config = EngineConfig(
        model="demo",
        dtype="float32",
        device="cpu",
        num_blocks=TEST_NUM_BLOCKS,
        max_model_len=TEST_MAX_MODEL_LEN,
        **overrides,
    )
    if os.environ.get("PREFIXCACHE_TEST_ENGINE") == "process":  # the same tests, core apart
        from prefixcache.engine.serving.process_engine import ProcessEngine

        return ProcessEngine(config)
    return AsyncEngine(config, loaded)


@pytest.fixture(scope="session")
def sidecar_server(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[Server]:
    server = serve(server_loop, create_app(demo_engine(demo_loaded), SidecarSettings()))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sidecar_url(sidecar_server: Server) -> str:
    return sidecar_server.url


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": list(KEYS.values())}))
    return str(path)


@pytest.fixture(scope="session")
def tenant_server(
    server_loop: ServerLoop, sidecar_server: Server, keys_file: str
) -> Iterator[Server]:
    engine = sidecar_server.app.state.sidecar.engine  # same engine, same blocks
    settings = SidecarSettings(keys=KeyStore.from_file(keys_file), manage_engine=False)
    server = serve(server_loop, create_app(engine, settings))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nocache_server(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[Server]:
    engine = demo_engine(demo_loaded, enable_prefix_caching=False, max_num_seqs=1)
    server = serve(server_loop, create_app(engine, SidecarSettings(max_waiting=2)))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fake_server(server_loop: ServerLoop) -> Iterator[Server]:
    from sidecar_fake_engine import FakeEngine

    server = serve(server_loop, create_app(FakeEngine(), SidecarSettings(max_body_bytes=65536)))
    yield server
    server.stop()


def health_gaps_while(root: str, work: Callable[[], object]) -> list[float]:
    """Run ``work`` on a thread and probe ``root``'s /health until it returns: each probe's
    seconds (an event loop that something held answers late)."""
    asking = threading.Thread(target=work)
    asking.start()
    gaps = []
    while asking.is_alive():
        start = time.perf_counter()
        assert httpx.get(f"{root}/health", timeout=10).status_code == 200
        gaps.append(time.perf_counter() - start)
        time.sleep(0.05)
    asking.join()
    return gaps


def wait_for_idle_blocks(root: str, timeout: float = 10, headers: dict | None = None) -> dict:
    """Poll /v1/cache/stats until no block is in use; return the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{root}/v1/cache/stats", headers=headers, timeout=5).json()
        if stats["blocks"]["in_use"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tools_sidecar(server_loop: ServerLoop, demo_loaded: Any) -> Iterator[Server]:
    """The demo model with a Llama-3.1-style tools template (``--chat-template``), answering
    to "demo" and "claude-test": for the Messages and Responses API tests."""
    from tool_templates import LLAMA31_STYLE

    engine = demo_engine(demo_loaded, chat_template=LLAMA31_STYLE)  # --chat-template
    settings = SidecarSettings(model_aliases=("demo", "claude-test"))
    server = serve(server_loop, create_app(engine, settings))
    yield server
    server.stop()


API_KEYS = {
    "x": {"key": "sk-test-tenant-x-01", "tenant": "tenant-x", "admin": False},
    "y": {"key": "sk-test-tenant-y-01", "tenant": "tenant-y", "admin": False},
}


@pytest.fixture(scope="session")
def api_tenant_server(
    server_loop: ServerLoop, tools_sidecar: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A second app over ``tools_sidecar``'s engine with two tenants of its own (so that the
    Messages and Responses tests' requests never warm another test's tenants)."""
    path = tmp_path_factory.mktemp("api-keys") / "keys.json"
    path.write_text(json.dumps({"keys": list(API_KEYS.values())}))
    engine = tools_sidecar.app.state.sidecar.engine
    settings = SidecarSettings(
        keys=KeyStore.from_file(path), manage_engine=False, model_aliases=("claude-test",)
    )
    server = serve(server_loop, create_app(engine, settings))
    yield server
    server.stop()
