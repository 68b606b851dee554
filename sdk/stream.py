"""CompletionStream: one streamed answer, read as deltas (OpenAI chunks or Anthropic events).

The client hands it a ``send`` that opens the response (with the client's retries); from the
first byte on nothing is retried, and errors sent in-band raise ``StreamError``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import anyio
import httpx
import msgspec

from . import anthropic_wire, errors
from .sse import SSEDecoder
from .timeouts import Timeouts, deadline_in, earliest, remaining
from .types import CacheReport, ChatCompletion, Delta, Usage, to_delta, usage_with_report

OnFinished = Callable[[Usage | None, CacheReport | None, str], None]  # usage, report, model


class Send(Protocol):
    async def __call__(
        self,
        method: str,
        path: str,
        body: Any,
        deadline: float | None,
        *,
        stream: bool,
        deadline_kind: errors.TimeoutKind = "total",
        timeouts: Timeouts | None = None,
    ) -> httpx.Response: ...


class CompletionStream:
    """Deltas of one streamed answer. After iteration: ``text``, ``finish_reason``,
    ``usage``, ``cache``, ``model`` and ``ttft`` (seconds from sending to the first text)."""

    def __init__(
        self,
        send: Send,
        path: str,
        body: dict[str, Any],
        timeouts: Timeouts,
        *,
        anthropic: bool = False,
        on_finished: OnFinished | None = None,
    ) -> None:
        self._send = send
        self._path = path
        self._body = body
        self._timeouts = timeouts
        self._anthropic = anthropic_wire.AnthropicStream() if anthropic else None
        self._on_finished = on_finished
        self._raw_usage: Usage | None = None
        self._iter = self._run()
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.cache: CacheReport | None = None
        self.model: str = body.get("model") or ""
        self.ttft: float | None = None

    def __aiter__(self) -> CompletionStream:
        return self

    async def __anext__(self) -> Delta:
        return await self._iter.__anext__()

    async def __aenter__(self) -> CompletionStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._iter.aclose()

    async def _run(self) -> AsyncGenerator[Delta, None]:
        start = anyio.current_time()
        deadline = deadline_in(self._timeouts.total)
        first = self._timeouts.first_token
        first_deadline = None if first is None else start + first
        limit = earliest(deadline, first_deadline)
        response = await self._send(
            "POST",
            self._path,
            self._body,
            limit,
            stream=True,
            deadline_kind="first_token" if limit == first_deadline else "total",
            timeouts=self._timeouts,
        )
        try:
            if "json" in response.headers.get("content-type", ""):
                # a server that ignored stream=true answered with one JSON body
                await response.aread()
                delta = self._parse(response.text, response, whole=True)
                self.ttft = anyio.current_time() - start
                if delta is not None:
                    yield delta
                self._finished()
                return
            lines = response.aiter_lines()
            decoder = SSEDecoder()
            while True:
                waiting_first = self.ttft is None
                limit = earliest(deadline, first_deadline if waiting_first else None)
                ended = False
                try:
                    with anyio.fail_after(remaining(limit)):
                        line = await lines.__anext__()
                except StopAsyncIteration:
                    ended, sse = True, decoder.flush()  # ended without a blank line / [DONE]
                except TimeoutError:
                    kind: errors.TimeoutKind = (
                        "first_token" if waiting_first and limit == first_deadline else "total"
                    )
                    raise errors.APITimeoutError(f"{kind} timeout exceeded", kind=kind) from None
                except httpx.TransportError as exc:  # the stream started: never retried
                    raise errors.APIConnectionError(f"stream interrupted: {exc!r}") from exc
                else:
                    sse = decoder.feed(line.rstrip("\r\n"))
                if sse is not None:
                    if sse.data == "[DONE]":
                        self._finished()
                        return
                    delta = self._parse(sse.data, response)
                    if delta is not None:
                        if self.ttft is None and (delta.text or delta.finish_reason):
                            self.ttft = anyio.current_time() - start
                        yield delta
                if ended:
                    if self.finish_reason is None:  # a clean EOF before the last chunk
                        raise errors.APIConnectionError(
                            "stream ended before its last chunk (no finish_reason or [DONE])"
                        )
                    self._finished()
                    return
        finally:
            await response.aclose()

    def _parse(self, data: str, response: httpx.Response, whole: bool = False) -> Delta | None:
        try:
            payload = json.loads(data)
        except ValueError as exc:
            raise errors.ResponseFormatError(
                f"stream event is not JSON: {data[:200]!r}", response=response
            ) from exc
        if isinstance(payload, dict) and payload.get("error") is not None:
            raise errors.stream_error(payload, response)
        try:
            delta = self._to_delta(payload, whole)
        except msgspec.ValidationError as exc:
            raise errors.ResponseFormatError(f"bad stream chunk: {exc}", response=response) from exc
        if delta is None:
            return None
        self.text += delta.text
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.cache = delta.cache or self.cache
        self._raw_usage = delta.usage or self._raw_usage
        # the sidecar's report and the usage come in different chunks: combine them (Anthropic
        # usage says what was written itself, and stays as it is)
        if self._anthropic is not None:
            self.usage = self._raw_usage
        else:
            self.usage = usage_with_report(self._raw_usage, self.cache)
        if delta.usage is not None:
            delta = msgspec.structs.replace(delta, usage=self.usage)
        return delta

    def _to_delta(self, payload: Any, whole: bool) -> Delta | None:
        if self._anthropic is None:
            raw = msgspec.convert(payload, ChatCompletion)
            self.model = raw.model or self.model
            return to_delta(raw)
        if whole:
            message = anthropic_wire.to_completion(
                msgspec.convert(payload, anthropic_wire.AnthropicMessage)
            )
            self.model = message.model or self.model
            return Delta(message.text, message.finish_reason, message.usage)
        delta = self._anthropic.feed(msgspec.convert(payload, anthropic_wire.AnthropicEvent))
        self.model = self._anthropic.model or self.model
        return delta

    def _finished(self) -> None:
        if self._on_finished is not None:
            self._on_finished(self.usage, self.cache, self.model)
            self._on_finished = None  # once
