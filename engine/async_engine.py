"""``AsyncEngine``: the engine loop on its own thread, an asyncio API for the sidecar.

The event loop never runs model code. Requests and admin calls go to the engine thread as
commands; each step's outputs come back to the loop in one ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry

from prefixcache.sdk.cache_stats import CacheStats

from . import prefix_store
from .api import RequestRecord, TreeSnapshot, WarmResult, compute_prefix
from .config import EngineConfig
from .engine import LLMEngine
from .loader import LoadedModel
from .output import aborted_output
from .prefix_store import LoadResult, SaveResult
from .request import EngineRequest, RequestOutput
from .tokenizer import Tokenizer

log = logging.getLogger("prefixcache.engine")
T = TypeVar("T")


class EngineNotReadyError(RuntimeError):
    pass


class AsyncEngine:
    """The in-process ``EngineAPI`` (engine/api.py)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._loaded = loaded
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._stats = CacheStats()
        self._ids = itertools.count()
        self._thread_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, which loads the model (off the event loop) and steps."""
        if self._engine is not None or (self._thread is not None and self._thread.is_alive()):
            return
        self._loop = asyncio.get_running_loop()
        # The engine thread loads the model itself: torch's libgomp keeps one thread team per
        # thread that opens parallel regions, and a second team (a loader thread's) on a
        # small machine throttles every worker's spin, slowing each step by 20-25 %.
        loaded: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._load_and_run, args=(loaded,), name="prefixcache-engine", daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(loaded)

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._engine is not None:
            self._engine.close()  # the KV tier's writer and file
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(aborted_output(request_id, "engine shut down"))

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and not self._stopping and self._thread_error is None

    @property
    def error(self) -> str | None:
        """Why the engine cannot serve although it started (its thread died, or its last step
        failed as a whole); None while it works."""
        if self._thread_error is not None:
            return self._thread_error
        return self._engine.error if self._engine is not None else None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineNotReadyError("the engine is still loading")
        return self._engine

    @property
    def model_name(self) -> str:
        return self.engine.loaded.name

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's generation_config.json sampling values (for unset request fields)."""
        return self.engine.loaded.sampling_defaults

    @property
    def dtype(self) -> str:
        return str(self.engine.loaded.dtype).removeprefix("torch.")

    @property
    def cache_identity(self) -> bytes:
        """Model fingerprint, tokenizer fingerprint and dtype: the root of every namespace."""
        return self.engine.cache_identity(self.engine.loaded)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def registry(self) -> CollectorRegistry:
        return self.engine.metrics.registry

    @property
    def num_waiting(self) -> int:
        return self._engine.num_waiting if self._engine else 0

    @property
    def num_running(self) -> int:
        return self._engine.num_running if self._engine else 0

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Leaving the loop early (or being cancelled) aborts it."""
        engine = self.engine
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = time.monotonic()
        finished = False
        try:
            await self._call(lambda: engine.add_request(request, arrival))
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Free everything the request holds. Safe from any thread; unknown ids are ignored."""
        self._submit(lambda: self._abort(request_id))

    # -- cache admin -------------------------------------------------------------------------

    async def warm(
        self,
        token_ids: list[int],
        namespace: str = "",
        pin: bool = False,
        ttl_s: float | None = None,
    ) -> WarmResult:
        """Compute and cache a prefix (its full blocks), optionally pinning them (for ``ttl_s``
        seconds, renewed by hits and warms; None: until unpinned)."""
        request_id = f"warm-{next(self._ids)}-{time.monotonic_ns()}"
        cached = await compute_prefix(self.generate, request_id, token_ids, namespace)
        pinned = 0
        if pin:
            pinned = await self._call(lambda: self.engine.pin(token_ids, namespace, ttl_s))
        return WarmResult(len(token_ids), cached, pinned)

    async def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return await self._call(lambda: self.engine.unpin(token_ids, namespace))

    async def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        """Evict the pool's idle blocks and empty the KV tier (``keep_tier``: spill into it)."""
        return await self._call(lambda: self.engine.evict_all(include_pinned, keep_tier))

    async def save_pinned(self, path: str | Path, key: bytes) -> SaveResult:
        """Write every pinned prefix and its KV to ``path`` (the file work off the engine thread)."""
        snap = await self._call(self.engine.snapshot_pinned)
        return await asyncio.to_thread(prefix_store.write, snap, path, key)

    async def load_pinned(self, path: str | Path, key: bytes) -> LoadResult:
        """Cache and pin the prefixes of a file ``save_pinned`` wrote with this model."""
        engine = self.engine
        snap = await asyncio.to_thread(engine.read_pinned, path, key)
        return await self._call(lambda: engine.restore_pinned(snap))

    def cache_stats(self) -> CacheStats:
        """The latest block snapshot, refreshed by the engine thread after every step and
        command, with the tokenizer's piece counts as of now (it runs on the caller's side)."""
        if self._engine is None:
            return self._stats
        return msgspec.structs.replace(self._stats, tokenizer_pieces=self._engine.piece_stats())

    async def cache_tree(self) -> TreeSnapshot:
        return await self._call(self.engine.activity.snapshot)

    def cache_activity(self, after: int = 0) -> list[RequestRecord]:
        return self.engine.activity.records(after) if self._engine is not None else []

    # -- the engine thread -------------------------------------------------------------------

    def _load_and_run(self, loaded: concurrent.futures.Future[LLMEngine]) -> None:
        try:
            engine = LLMEngine(self.config, self._loaded)
        except BaseException as exc:  # start() raises it
            loaded.set_exception(exc)
            return
        self._stats = engine.cache_stats()
        self._engine = engine
        loaded.set_result(engine)
        self._run()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_commands()
                if engine.has_unfinished:
                    try:
                        outputs = engine.step()
                    except Exception as exc:  # a bug outside the model step: fail everything
                        log.exception("engine step failed")
                        engine.error = f"internal engine error: {type(exc).__name__}: {exc}"
                        outputs = engine.fail_all("engine_error", engine.error)
                    self._publish(outputs)  # first: the loop waits for these, not for the stats
                    self._stats = engine.cache_stats()
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        except BaseException as exc:
            self._thread_error = f"the engine thread died: {type(exc).__name__}: {exc}"
            log.exception("the engine thread died")
            self._publish([aborted_output(rid, self._thread_error) for rid in list(self._streams)])
            raise

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        self._stats = self.engine.cache_stats()
        if out is not None:
            self._publish([out])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its result (or exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def command() -> None:
            try:
                result, error = fn(), None
            except Exception as exc:
                result, error = None, exc
            self._stats = self.engine.cache_stats()  # visible before the caller resumes
            loop.call_soon_threadsafe(settle, result, error)

        self._submit(command)
        return await future
