"""``ProcessEngine``: the ``EngineAPI`` (engine/api.py) over an engine core in its own process.

The core (core_process.py) runs ``EngineCore`` in a spawned interpreter; this side keeps the
tokenizer (the sidecar renders and tokenizes here), and the client state ``EngineClient``
shares with ``AsyncEngine``, plus a mirror of the core's Prometheus series. One duplex pipe
carries msgpack messages (engine_wire.py); the event loop reads it through ``add_reader``, so
no thread of this process touches the model's GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from prefixcache.sdk.cache_stats import CacheStats

from ..config import EngineConfig
from ..text.tokenizer import Tokenizer
from . import engine_wire as wire
from .engine_client import EngineClient
from .errors import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    EngineProcessError,
    EngineStartError,
)

__all__ = [
    "EngineDeadError",
    "EngineError",
    "EngineNotReadyError",
    "EngineProcessError",
    "EngineStartError",
    "ProcessEngine",
]
log = logging.getLogger("prefixcache.engine")
START_TIMEOUT_S = 600.0


class _MirroredMetrics(Collector):
    """The core's registry as of its last report, served from this process's registry."""

    def __init__(self) -> None:
        self.families: list[wire.MetricFamily] = []

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            metric = Metric(f.name, f.documentation, f.type, f.unit)
            for s in f.samples:
                metric.add_sample(s.name, s.labels, s.value)
            yield metric


def _run_core(conn: Any, config: EngineConfig, log_level: int, parent_pid: int) -> None:
    """The child's entry point, named here so that this side never imports the engine (torch)."""
    from .core_process import run_core

    run_core(conn, config, log_level, parent_pid)


class ProcessEngine(EngineClient):
    """The ``EngineAPI`` with the engine core in a child process (``prefixcache serve``'s
    default, ``--engine process``). ``AsyncEngine`` is the same API with the core on a thread
    (``--engine thread``)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._process: Any = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._encoder = wire.encoder()
        self._decoder = wire.api_decoder()
        self._metrics = _MirroredMetrics()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._metrics)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core and wait until it has loaded the model, building the tokenizer here
        meanwhile from the spec the core sends ahead of the weights."""
        if self._ready is not None:
            return
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        parent, child = ctx.Pipe(duplex=True)
        level = logging.getLogger("prefixcache").getEffectiveLevel()
        self._process = ctx.Process(
            target=_run_core,
            args=(child, self.config, level, os.getpid()),
            name="prefixcache-core",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._conn = parent
        first = await asyncio.to_thread(self._recv_first, parent)
        ahead = None  # the tokenizer built here while the core loads the weights
        if isinstance(first, wire.TokenizerAhead):
            spec, template = first.tokenizer, self.config.chat_template
            ahead = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_spec, spec, template))
            first = await asyncio.to_thread(self._recv_first, parent)
        if not isinstance(first, wire.Ready):
            if ahead is not None:
                with contextlib.suppress(Exception):
                    await ahead
            await asyncio.to_thread(self._process.join, 10)
            message = first.message if isinstance(first, wire.Failed) else repr(first)
            raise EngineStartError(message)  # what the core said, once
        tokenizer = None
        if ahead is not None:
            with contextlib.suppress(Exception):  # else built from Ready's spec below
                tokenizer = await ahead
        if tokenizer is None or tokenizer.fingerprint != first.tokenizer_fingerprint:
            tokenizer = await asyncio.to_thread(self._load_tokenizer, first)
        self._on_ready(first, tokenizer)
        self._loop.add_reader(parent.fileno(), self._on_readable)
        # uvloop (uvicorn's loop) makes a watched fd non-blocking; Connection's framing needs
        # whole reads and writes (a partial one raised BlockingIOError and lost the core).
        os.set_blocking(parent.fileno(), True)

    @staticmethod
    def _recv_first(conn: Any) -> wire.TokenizerAhead | wire.Ready | wire.Failed:
        if not conn.poll(START_TIMEOUT_S):
            raise EngineDeadError(f"the engine did not start in {START_TIMEOUT_S:.0f} s")
        try:
            msg = wire.api_decoder().decode(conn.recv_bytes())
        except EOFError as e:
            raise EngineDeadError("the engine process exited while starting") from e
        assert isinstance(msg, wire.TokenizerAhead | wire.Ready | wire.Failed)
        return msg

    @staticmethod
    def _load_tokenizer(ready: wire.Ready) -> Tokenizer:
        """The core's tokenizer, built from what it sent (any model source: a Hugging Face
        folder, a GGUF file, a named model, the demo), with no model file read here."""
        tok = Tokenizer.from_spec(ready.tokenizer)
        if tok.fingerprint != ready.tokenizer_fingerprint:
            raise EngineDeadError("the tokenizer here differs from the engine's")
        return tok

    async def shutdown(self) -> None:
        self._stopping = True
        if self._conn is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._conn.fileno())
            self._send(wire.Shutdown())
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 30)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._fail_everything("engine shut down")

    @property
    def core_pid(self) -> int | None:
        """The core process's id while it runs (None before start and after shutdown)."""
        return self._process.pid if self._process is not None else None

    @property
    def registry(self) -> CollectorRegistry:
        return self._registry

    # -- the pipe ----------------------------------------------------------------------------

    def _send(self, msg: wire.ToCore) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (BrokenPipeError, OSError, AttributeError):
                if not self._stopping:
                    self._on_exit("the engine process is gone")

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                self._handle(self._decoder.decode(conn.recv_bytes()))
        except (EOFError, OSError):
            self._on_exit("the engine process exited")

    def _apply_stats(
        self, stats: CacheStats | None, metrics: list[wire.MetricFamily] | None
    ) -> None:
        super()._apply_stats(stats, metrics)
        if metrics is not None:
            self._metrics.families = metrics

    def _on_exit(self, reason: str) -> None:
        loop, conn = self._loop, self._conn
        if self._exited is None and loop is not None and conn is not None and not loop.is_closed():
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(conn.fileno())
        super()._on_exit(reason)
