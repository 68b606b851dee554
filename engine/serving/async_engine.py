"""``AsyncEngine``: the engine core on a thread of this process, an asyncio API for the sidecar.

The event loop never runs model code. The core (engine_core.py) steps on its own thread;
commands reach it through its inbox, and each of its messages comes back to the loop in one
``call_soon_threadsafe``. The client side is ``EngineClient``, shared with ``ProcessEngine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry

from ..api import LoadResult, PrefixStoreError, SaveResult
from ..config import EngineConfig
from ..engine import LLMEngine
from ..memory import prefix_store
from ..memory.prefix_store import Snapshot
from ..model.loader import LoadedModel
from ..step.engine_hooks import EngineHooks
from . import engine_wire as wire
from .engine_client import EngineClient
from .engine_core import THREAD_CALLS, EngineCore
from .errors import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    EngineStartError,
    start_failure,
)

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineError",
    "EngineNotReadyError",
    "EngineStartError",
]
log = logging.getLogger("prefixcache.engine")
T = TypeVar("T")


class _LoopOutput:
    """The core's messages, handed to the client on its event loop (a ``CoreOutput``)."""

    mirrors_metrics = False  # the client reads the engine's registry itself

    def __init__(self, client: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.loop = loop

    def send(self, msg: wire.ToApi) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.client._handle, msg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True


class AsyncEngine(EngineClient):
    """The in-process ``EngineAPI`` (``--engine thread``)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        hooks: EngineHooks | None = None,
    ) -> None:
        super().__init__(config)
        self._loaded = loaded
        self._hooks = hooks
        self._engine: LLMEngine | None = None
        self._core: EngineCore | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, which loads the model (off the event loop) and steps."""
        if self._engine is not None or (self._thread is not None and self._thread.is_alive()):
            return
        self._loop = asyncio.get_running_loop()
        # The engine thread loads the model itself: torch's libgomp keeps one thread team per
        # thread that opens parallel regions, and a second team (a loader thread's) on a
        # small machine throttles every worker's spin, slowing each step by 20-25 %.
        started: concurrent.futures.Future[wire.Ready] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._load_and_run,
            args=(started, self._loop),
            name="prefixcache-engine",
            daemon=True,
        )
        self._thread.start()
        ready = await asyncio.wrap_future(started)
        assert self._engine is not None
        self._on_ready(ready, self._engine.tokenizer)

    async def shutdown(self) -> None:
        self._stopping = True
        if self._core is not None:
            self._core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._fail_everything("engine shut down")

    @property
    def engine(self) -> LLMEngine:
        """The engine itself (scripts and tests; its methods belong to the engine thread)."""
        if self._engine is None:
            raise EngineNotReadyError("the engine is still loading")
        return self._engine

    @property
    def registry(self) -> CollectorRegistry:
        return self.engine.metrics.registry

    async def run_on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` on the engine thread, between steps (scripts and tests)."""
        return await self._call("apply", [fn], object)  # type: ignore[return-value]

    # -- cache files: the I/O on a worker thread, the pages on the engine thread -------------

    async def save_pinned(self, path: str | Path, key: bytes) -> SaveResult:
        """Write every pinned prefix and its KV to ``path``."""
        snap = await self._call("snapshot_pinned", [], Snapshot)
        return await asyncio.to_thread(prefix_store.write, snap, path, key)

    async def load_pinned(self, path: str | Path, key: bytes) -> LoadResult:
        """Cache and pin the prefixes of a file ``save_pinned`` wrote with this model."""
        snap = await asyncio.to_thread(self.engine.read_pinned, path, key)
        return await self._call("restore_pinned", [snap], LoadResult, PrefixStoreError)

    # -- the transport -----------------------------------------------------------------------

    def _send(self, msg: wire.ToCore) -> None:
        if self._core is not None:
            self._core.submit(msg)

    def _load_and_run(
        self, started: concurrent.futures.Future[wire.Ready], loop: asyncio.AbstractEventLoop
    ) -> None:
        try:
            engine = LLMEngine(self.config, self._loaded, self._hooks)
        except BaseException as exc:  # start() raises it (one line's worth, where it can)
            started.set_exception(start_failure(exc) or exc)
            return
        core = EngineCore(engine, _LoopOutput(self, loop), THREAD_CALLS)
        self._engine, self._core = engine, core
        started.set_result(core.ready())
        try:
            core.run()
        except BaseException as exc:
            reason = f"the engine thread died: {type(exc).__name__}: {exc}"
            log.exception("the engine thread died")
            with contextlib.suppress(RuntimeError):  # a closed loop
                loop.call_soon_threadsafe(self._on_exit, reason)
            raise
        finally:
            engine.close()  # the KV tier's writer and file, queued KV events
