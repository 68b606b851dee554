"""Client: a blocking wrapper for scripts. It runs an ``AsyncClient`` on an event loop in a
background thread (an anyio blocking portal), so both share one implementation."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Unpack

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .client import AsyncClient, PromptFields, PromptLike
from .session_report import Prices, SessionReport
from .stream import CompletionStream
from .types import (
    CacheStats,
    Completion,
    Delta,
    LoadResult,
    ResetPrefixCacheResult,
    SaveResult,
    WarmResult,
)

_END = object()
_EVENT_LOOPS = ("asyncio", "trio")


class Client:
    """Same arguments and methods as ``AsyncClient``, blocking. Close it (or use ``with``).

    ``event_loop`` ("asyncio" or "trio") runs the client; ``backend`` is the API backend, as for
    ``AsyncClient`` (an older spelling, ``backend="asyncio"``/``"trio"``, still names the loop).
    A client left open is closed when it is garbage-collected or, at the latest, at
    interpreter exit.
    """

    def __init__(self, *args: Any, event_loop: str = "asyncio", **kwargs: Any) -> None:
        if kwargs.get("backend") in _EVENT_LOOPS:
            event_loop = kwargs.pop("backend")
        portal_cm = start_blocking_portal(event_loop)
        self._portal = portal_cm.__enter__()
        try:
            self._async: AsyncClient = self._portal.call(lambda: AsyncClient(*args, **kwargs))
        except BaseException:
            portal_cm.__exit__(None, None, None)
            raise
        # The loop thread is a daemon, but the portal's context manager, if left to module
        # teardown, would ask that (by then frozen) thread to stop and wait forever. A finalizer
        # closes the client first: on collection, or in atexit, while the thread still runs.
        self._closer = weakref.finalize(self, _shut_down, portal_cm, self._portal, self._async)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closer()  # runs once; later calls do nothing

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    @property
    def base_url(self) -> str:
        return self._async.base_url

    def complete(self, prompt: PromptLike, **params: Any) -> Completion:
        return self._portal.call(lambda: self._async.complete(prompt, **params))

    def stream(self, prompt: PromptLike, **params: Any) -> Iterator[Delta]:
        """Yield deltas as they arrive (closing the generator early closes the stream)."""
        stream: CompletionStream = self._async.stream(prompt, **params)
        try:
            while True:
                item = self._portal.call(_next, stream)
                if item is _END:
                    return
                yield item
        finally:
            self._portal.call(stream.aclose)

    def warm(
        self,
        prompt: PromptLike,
        pin: bool = False,
        cache_salt: str | None = None,
        ttl_s: float | None = None,
        **fields: Unpack[PromptFields],
    ) -> WarmResult:
        return self._portal.call(lambda: self._async.warm(prompt, pin, cache_salt, ttl_s, **fields))

    def unpin(
        self,
        prompt: PromptLike,
        cache_salt: str | None = None,
        **fields: Unpack[PromptFields],
    ) -> int:
        return self._portal.call(lambda: self._async.unpin(prompt, cache_salt, **fields))

    def evict(self, include_pinned: bool = False) -> int:
        return self._portal.call(lambda: self._async.evict(include_pinned))

    def reset_prefix_cache(self, reset_external: bool | None = None) -> ResetPrefixCacheResult:
        return self._portal.call(lambda: self._async.reset_prefix_cache(reset_external))

    def cache_stats(self) -> CacheStats:
        return self._portal.call(self._async.cache_stats)

    def cache_save(self, name: str = "pinned", allow_empty: bool = False) -> SaveResult:
        return self._portal.call(lambda: self._async.cache_save(name, allow_empty))

    def cache_load(self, name: str = "pinned") -> LoadResult:
        return self._portal.call(lambda: self._async.cache_load(name))

    def models(self) -> list[str]:
        return self._portal.call(self._async.models)

    def cache_report(self, prices: Prices | None = None) -> SessionReport:
        return self._portal.call(lambda: self._async.cache_report(prices))


def _shut_down(
    portal_cm: AbstractContextManager[BlockingPortal], portal: BlockingPortal, client: AsyncClient
) -> None:
    """Close the client on its loop, then stop the loop and join its thread."""
    try:
        portal.call(client.aclose)
    finally:
        portal_cm.__exit__(None, None, None)


async def _next(stream: CompletionStream) -> Any:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END
