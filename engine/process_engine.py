"""``ProcessEngine``: the ``EngineAPI`` (engine/api.py) over an engine core in its own process.

The core (engine_core.py) runs ``LLMEngine``'s step loop in a spawned interpreter; this side
keeps the tokenizer (the sidecar renders and tokenizes here), the request streams, and
mirrors of what the core reports after every step: cache stats, queue lengths and its
Prometheus series. One duplex pipe carries msgpack messages (engine_wire.py); the event loop
reads it through ``add_reader``, so no thread of this process touches the model's GIL.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from prefixcache.sdk.cache_stats import CacheStats

from . import engine_wire as wire
from .api import (
    LoadResult,
    PrefixStoreError,
    RequestRecord,
    SaveResult,
    TreeSnapshot,
    WarmResult,
    compute_prefix,
)
from .config import EngineConfig
from .output import aborted_output
from .request import EngineRequest, RequestOutput
from .tokenizer import Tokenizer

log = logging.getLogger("prefixcache.engine")
T = TypeVar("T")
START_TIMEOUT_S = 600.0


class EngineNotReadyError(RuntimeError):
    pass


class EngineProcessError(RuntimeError):
    """The engine core process failed to start or exited."""


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
    from .engine_core import run_core

    run_core(conn, config, log_level, parent_pid)


RECORDS_KEPT = 2000  # finished requests remembered for the dashboard (as CacheActivity keeps)


class ProcessEngine:
    """The ``EngineAPI`` with the engine core in a child process (``prefixcache serve``'s
    default, ``--engine process``). ``AsyncEngine`` is the same API with the core on a thread
    (``--engine thread``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._ready: wire.Ready | None = None
        self._tokenizer: Tokenizer | None = None
        self._process: Any = None
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self._encoder = wire.encoder()
        self._decoder = wire.api_decoder()
        self._streams: dict[str, asyncio.Queue[RequestOutput | wire.Refusal]] = {}
        self._calls: dict[int, asyncio.Future[wire.Reply]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._stats = CacheStats()
        self._num_waiting = 0
        self._num_running = 0
        self._stopping = False
        self._exited: str | None = None
        self._core_error: str | None = None
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=RECORDS_KEPT)
        self._metrics = _MirroredMetrics()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._metrics)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core, wait until it has loaded the model, then load the tokenizer here."""
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
        if isinstance(first, wire.Failed):
            await asyncio.to_thread(self._process.join, 10)
            raise EngineProcessError(f"the engine failed to start: {first.message}")
        tokenizer = await asyncio.to_thread(self._load_tokenizer, first)
        self._tokenizer, self._ready = tokenizer, first
        self._apply_stats(first.stats, first.metrics)
        self._loop.add_reader(parent.fileno(), self._on_readable)
        # uvloop (uvicorn's loop) makes a watched fd non-blocking; Connection's framing needs
        # whole reads and writes (a partial one raised BlockingIOError and lost the core).
        os.set_blocking(parent.fileno(), True)

    @staticmethod
    def _recv_first(conn: Any) -> wire.Ready | wire.Failed:
        if not conn.poll(START_TIMEOUT_S):
            raise EngineProcessError(f"the engine did not start in {START_TIMEOUT_S:.0f} s")
        try:
            msg = wire.api_decoder().decode(conn.recv_bytes())
        except EOFError as e:
            raise EngineProcessError("the engine process exited while starting") from e
        assert isinstance(msg, wire.Ready | wire.Failed)
        return msg

    @staticmethod
    def _load_tokenizer(ready: wire.Ready) -> Tokenizer:
        """The core's tokenizer, built from what it sent (any model source: a Hugging Face
        folder, a GGUF file, a named model, the demo), with no model file read here."""
        tok = Tokenizer.from_spec(ready.tokenizer)
        if tok.fingerprint != ready.tokenizer_fingerprint:
            raise EngineProcessError("the tokenizer here differs from the engine's")
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
    def is_ready(self) -> bool:
        return self._ready is not None and not self._stopping and self._exited is None

    def _info(self) -> wire.Ready:
        if self._ready is None:
            raise EngineNotReadyError("the engine is still loading")
        return self._ready

    @property
    def model_name(self) -> str:
        return self._info().model_name

    @property
    def dtype(self) -> str:
        """The weights' and KV cache's dtype, as torch names it (``bfloat16``)."""
        return self._info().dtype

    @property
    def sampling_defaults(self) -> dict[str, float]:
        return self._info().sampling_defaults

    @property
    def cache_identity(self) -> bytes:
        return self._info().cache_identity

    @property
    def tokenizer(self) -> Tokenizer:
        self._info()
        assert self._tokenizer is not None
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._info().max_model_len

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def registry(self) -> CollectorRegistry:
        return self._registry

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Leaving the loop early (or being cancelled) aborts it.
        A request the engine refuses (``LLMEngine.validate``) raises ValueError first."""
        self._check_running()
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | wire.Refusal] = asyncio.Queue()
        self._streams[request_id] = stream
        self._num_waiting += 1  # until the core's next report: admission control counts it
        finished = False
        try:
            self._send(wire.Add(request, time.monotonic()))
            while not finished:
                out = await stream.get()
                if isinstance(out, wire.Refusal):
                    finished = True  # nothing of it is left in the core
                    raise ValueError(out.message)
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Free everything the request holds. Safe from any thread; unknown ids are ignored."""
        if self._conn is not None and self._exited is None and not self._stopping:
            self._send(wire.Abort(request_id))

    # -- cache admin -------------------------------------------------------------------------

    async def warm(
        self,
        token_ids: list[int],
        namespace: str = "",
        pin: bool = False,
        ttl_s: float | None = None,
    ) -> WarmResult:
        request_id = f"warm-{next(self._ids)}-{time.monotonic_ns()}"
        cached = await compute_prefix(self.generate, request_id, token_ids, namespace)
        pinned = await self._call("pin", [list(token_ids), namespace, ttl_s], int) if pin else 0
        return WarmResult(len(token_ids), cached, pinned)

    async def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return await self._call("unpin", [list(token_ids), namespace], int)

    async def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        return await self._call("evict_all", [include_pinned, keep_tier], int)

    async def save_pinned(self, path: str | Path, key: bytes) -> SaveResult:
        return await self._call("save_pinned", [str(path), key], SaveResult)

    async def load_pinned(self, path: str | Path, key: bytes) -> LoadResult:
        return await self._call("load_pinned", [str(path), key], LoadResult, PrefixStoreError)

    async def cache_tree(self) -> TreeSnapshot:
        return await self._call("cache_tree", [], TreeSnapshot)

    def cache_activity(self, after: int = 0) -> list[RequestRecord]:
        """The finished requests the core reported with ``seq > after`` (a bounded ring)."""
        return [r for r in self._records if r.seq > after]

    @property
    def error(self) -> str | None:
        """Why the engine cannot serve although it started (its process is gone, or its last
        step failed as a whole); None while it works."""
        return self._exited if self._exited is not None and not self._stopping else self._core_error

    def cache_stats(self) -> CacheStats:
        """The core's latest block snapshot, with this side's tokenizer piece counts (the
        sidecar tokenizes here)."""
        tok = self._tokenizer
        pieces = tok.piece_cache if tok is not None else None
        if pieces is None:
            return self._stats
        from prefixcache.sdk.cache_stats import TokenizerPieceStats

        s = pieces.stats
        counts = TokenizerPieceStats(hits=s.hits, misses=s.misses, entries=s.entries, chars=s.chars)
        return msgspec.structs.replace(self._stats, tokenizer_pieces=counts)

    async def _call(
        self,
        method: str,
        args: list[Any],
        result_type: type[T],
        error_type: type[ValueError] = ValueError,
    ) -> T:
        self._check_running()
        assert self._loop is not None
        call_id = next(self._call_ids)
        future: asyncio.Future[wire.Reply] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(wire.Call(call_id, method, args))
            reply = await future
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise error_type(reply.error)
        return msgspec.msgpack.decode(reply.result, type=result_type)

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

    def _handle(self, msg: wire.ToApi) -> None:
        if isinstance(msg, wire.Step):
            if msg.stats is not None or msg.metrics is not None:
                self._apply_stats(msg.stats, msg.metrics)
            self._num_waiting, self._num_running = msg.num_waiting, msg.num_running
            self._core_error = msg.error
            self._records.extend(msg.records)
            for item in (*msg.refused, *msg.outputs):
                stream = self._streams.get(item.request_id)
                if stream is not None:
                    stream.put_nowait(item)
        elif isinstance(msg, wire.Reply):
            self._apply_stats(msg.stats, msg.metrics)
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)

    def _apply_stats(
        self, stats: CacheStats | None, metrics: list[wire.MetricFamily] | None
    ) -> None:
        if stats is not None:
            self._stats = stats
        if metrics is not None:
            self._metrics.families = metrics

    def _check_running(self) -> None:
        self._info()
        if self._exited is not None:
            raise EngineProcessError(self._exited)
        if self._stopping:
            raise EngineNotReadyError("the engine is shutting down")

    def _on_exit(self, reason: str) -> None:
        if self._exited is not None:
            return
        self._exited = reason
        if not self._stopping:
            log.error("%s", reason)
        if self._loop is not None and self._conn is not None and not self._loop.is_closed():
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._conn.fileno())
        self._fail_everything(reason)

    def _fail_everything(self, reason: str) -> None:
        for request_id, stream in list(self._streams.items()):
            out = aborted_output(request_id, reason)
            stream.put_nowait(out)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineProcessError(reason))
