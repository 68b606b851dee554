"""SSE responses and client-disconnect detection, in plain ASGI.

Starlette's convenience layers can hide a disconnect until the next write; a request still
waiting in the engine queue writes nothing. So both helpers here race the work against
``receive()`` returning ``http.disconnect`` and cancel the work when the client goes first.
Cancelling closes the engine iterator, which aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the work finished."""


def sse_event(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has gone. Call only after the request body was read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone.

    ``work`` runs in the caller's task, so the engine request starts without a loop hop and
    the result is back without one; only the watcher is a task of its own.
    """
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await wait_for_disconnect(receive)
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone or current.uncancel() > 0:
            raise  # we are cancelled ourselves (server shutting down), maybe as well
        raise ClientGone from None
    finally:
        watcher.cancel()


async def interleave(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of ``sources`` tagged with their source's index, in the order they come. The
    first failure ends it (raised here) and cancels the other sources; closing it does too.
    One source is read in place, without a task."""
    if len(sources) == 1:
        async with contextlib.aclosing(sources[0]) as source:  # type: ignore[type-var]
            async for item in source:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, bool, Any]] = asyncio.Queue()  # (source, done, item)

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(source) as items:  # type: ignore[type-var]
                async for item in items:
                    await queue.put((index, False, item))
            await queue.put((index, True, None))
        except Exception as exc:
            await queue.put((index, True, exc))

    tasks = [asyncio.ensure_future(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            index, done, item = await queue.get()
            if not done:
                yield index, item
                continue
            if item is not None:
                raise item
            running -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse:
    """An ASGI response that streams ``events`` (already-encoded SSE frames)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close  # runs in every case, even if no event was produced
        self.headers = headers or {}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **self.headers,
        }
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
                }
            )
            with contextlib.suppress(ClientGone):
                await run_until_disconnect(self._produce(send), receive)
        finally:
            if self.on_close is not None:
                await self.on_close()

    async def _produce(self, send: Send) -> None:
        async with contextlib.aclosing(self.events) as events:  # type: ignore[type-var]
            try:
                async for frame in events:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            except OSError:  # the transport went away mid-write
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
