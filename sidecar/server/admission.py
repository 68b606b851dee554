"""Admission: the waiting-queue limit, and the engine stream that counts towards it.

A request counts as waiting from admission until its first output. The engine's own
``num_waiting`` is updated on the engine thread, so a burst of requests could all read the
same stale value; counting admitted-but-unstarted requests here closes that window.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from prefixcache.engine.api import EngineAPI
from prefixcache.engine.request import EngineRequest, RequestOutput

from ..http.errors import bad_request, overloaded


class Admission:
    def __init__(self, engine: EngineAPI, max_waiting: int, retry_after_s: int = 1) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0  # admitted here, no output yet

    def can_admit(self) -> bool:
        return max(self.num_waiting, self.engine.num_waiting) < self.max_waiting

    def admit(self, request: EngineRequest) -> EngineStream:
        """Raises 429 over the limit. The caller must ``aclose()`` the stream in every case."""
        if not self.can_admit():
            raise overloaded(self.retry_after_s)
        self.num_waiting += 1
        return EngineStream(self, request)


class EngineStream:
    """``engine.generate(request)`` started lazily; ``aclose()`` aborts it (idempotent)."""

    def __init__(self, admission: Admission, request: EngineRequest) -> None:
        self._admission = admission
        self.request = request
        self._outputs: AsyncGenerator[RequestOutput, None] | None = None
        self._counted = True
        self._closed = False

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        if self._outputs is None:
            self._outputs = self._admission.engine.generate(self.request)
        try:
            output = await anext(self._outputs)
        except ValueError as exc:  # the engine's own input checks (ours should catch it first)
            raise bad_request(f"the engine refused the request: {exc}") from None
        self._uncount()
        return output

    async def aclose(self) -> None:
        self._uncount()
        if self._closed:
            return
        self._closed = True
        if self._outputs is not None:
            await self._outputs.aclose()

    def discard(self) -> None:
        """Give up a stream never iterated (a sibling choice was refused): its place back."""
        assert self._outputs is None, "discard() is for a stream that never started"
        self._uncount()
        self._closed = True

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._admission.num_waiting -= 1
