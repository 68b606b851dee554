"""``EngineClient``: the ``EngineAPI`` (engine/api.py) over an ``EngineCore``'s messages.

Both clients are this class over a transport: ``AsyncEngine`` (the core on a thread of this
process) and ``ProcessEngine`` (the core in a child process). A client is built from the
core's ``Ready`` message and keeps the request streams, the pending calls, and mirrors of
what the core reports with every ``Step`` and ``Reply``: cache stats, queue lengths, the
step error and the finished-request records. A transport supplies ``start``, ``shutdown``,
``registry`` and ``_send``, and hands every message from the core to ``_handle`` on the
event loop. Torch-free.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry

from prefixcache.sdk.cache_stats import CacheStats

from ..api import (
    LoadResult,
    PrefixStoreError,
    RequestRecord,
    SaveResult,
    TreeSnapshot,
    WarmResult,
    compute_prefix,
)
from ..config import EngineConfig
from ..observability.cache_report import piece_stats
from ..request import EngineRequest, RequestOutput
from ..step.output import aborted_output
from ..text.tokenizer import Tokenizer
from . import engine_wire as wire
from .errors import EngineDeadError, EngineNotReadyError

log = logging.getLogger("prefixcache.engine")
T = TypeVar("T")
RECORDS_KEPT = 2000  # finished requests remembered for the dashboard (as CacheActivity keeps)


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._ready: wire.Ready | None = None
        self._tokenizer: Tokenizer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | wire.Refusal]] = {}
        self._calls: dict[int, asyncio.Future[wire.Reply]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._stats = CacheStats()
        self._num_waiting = 0
        self._num_running = 0
        self._stopping = False
        self._exited: str | None = None  # why the core is gone (None while it runs)
        self._core_error: str | None = None
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=RECORDS_KEPT)

    # -- the transport's part ----------------------------------------------------------------

    def _send(self, msg: wire.ToCore) -> None:
        raise NotImplementedError

    @property
    def registry(self) -> CollectorRegistry:
        """The engine's Prometheus series, served on /metrics with the HTTP ones."""
        raise NotImplementedError

    def _on_ready(self, ready: wire.Ready, tokenizer: Tokenizer) -> None:
        self._tokenizer, self._ready = tokenizer, ready
        self._apply_stats(ready.stats, ready.metrics or None)

    # -- readiness and the model card (from the core's Ready) --------------------------------

    @property
    def is_ready(self) -> bool:
        return self._ready is not None and not self._stopping and self._exited is None

    @property
    def error(self) -> str | None:
        """Why the engine cannot serve although it started (its core is gone, or its last
        step failed as a whole); None while it works."""
        return self._exited if self._exited is not None and not self._stopping else self._core_error

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
        """The model's generation_config.json sampling values (for unset request fields)."""
        return self._info().sampling_defaults

    @property
    def cache_identity(self) -> bytes:
        """Model fingerprint, tokenizer fingerprint and dtype: the root of every namespace."""
        return self._info().cache_identity

    @property
    def output_identity(self) -> bytes:
        """``cache_identity``, or a digest of it and what else changes the logits (the
        integer LM head): the root of the sidecar's ``system_fingerprint``."""
        return self._info().output_identity

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
        if self._ready is not None and self._exited is None and not self._stopping:
            self._send(wire.Abort(request_id))

    def abort_all(self, message: str) -> int:
        """End every stream now (its last output says ``message``) and abort its request; on
        the event loop (a server's drain before its shutdown cancels what is left)."""
        streams = list(self._streams.items())
        for request_id, stream in streams:
            stream.put_nowait(aborted_output(request_id, message))
            self.abort(request_id)
        return len(streams)

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
        pinned = await self._call("pin", [list(token_ids), namespace, ttl_s], int) if pin else 0
        return WarmResult(len(token_ids), cached, pinned)

    async def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return await self._call("unpin", [list(token_ids), namespace], int)

    async def evict_all(self, include_pinned: bool = False, keep_tier: bool = False) -> int:
        """Evict the pool's idle blocks and empty the KV tier (``keep_tier``: spill into it)."""
        return await self._call("evict_all", [include_pinned, keep_tier], int)

    async def save_pinned(self, path: str | Path, key: bytes) -> SaveResult:
        """Write every pinned prefix and its KV to ``path``."""
        return await self._call("save_pinned", [str(path), key], SaveResult)

    async def load_pinned(self, path: str | Path, key: bytes) -> LoadResult:
        """Cache and pin the prefixes of a file ``save_pinned`` wrote with this model."""
        return await self._call("load_pinned", [str(path), key], LoadResult, PrefixStoreError)

    async def cache_tree(self) -> TreeSnapshot:
        return await self._call("cache_tree", [], TreeSnapshot)

    def cache_activity(self, after: int = 0) -> list[RequestRecord]:
        """The finished requests the core reported with ``seq > after`` (a bounded ring)."""
        return [r for r in self._records if r.seq > after]

    def cache_stats(self) -> CacheStats:
        """The core's latest block snapshot, with the tokenizer's piece counts as of now (the
        sidecar tokenizes on this side)."""
        return msgspec.structs.replace(self._stats, tokenizer_pieces=piece_stats(self._tokenizer))

    async def _call(
        self,
        method: str,
        args: list[Any],
        result_type: type[T],
        error_type: type[ValueError] = ValueError,
    ) -> T:
        """Run an admin method of the core's engine; its ValueError raises ``error_type``."""
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
        return msgspec.convert(reply.result, result_type)  # an object of that type: as it is

    # -- messages from the core (on the event loop) ------------------------------------------

    def _handle(self, msg: wire.ToApi) -> None:
        if isinstance(msg, wire.Step):
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

    def _check_running(self) -> None:
        self._info()
        if self._exited is not None:
            raise EngineDeadError(self._exited)
        if self._stopping:
            raise EngineNotReadyError("the engine is shutting down")

    def _on_exit(self, reason: str) -> None:
        """The core is gone: every stream ends with an error, every pending call raises."""
        if self._exited is not None:
            return
        self._exited = reason
        if not self._stopping:
            log.error("%s", reason)
        self._fail_everything(reason)

    def _fail_everything(self, reason: str) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(aborted_output(request_id, reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
