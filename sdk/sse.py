"""Server-sent events: turn lines into events (https://html.spec.whatwg.org/#event-stream)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str | None = None


@dataclass(slots=True)
class SSEDecoder:
    """Feed lines without their line ending; a blank line dispatches the pending event."""

    _data: list[str] = field(default_factory=list)
    _event: str = ""
    _id: str | None = None

    def feed(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None  # "retry" and unknown fields are ignored

    def flush(self) -> ServerSentEvent | None:
        """The last event when the stream ended without a blank line."""
        return self._dispatch()

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data:
            self._event = ""
            return None
        sse = ServerSentEvent("\n".join(self._data), self._event or "message", self._id)
        self._data.clear()
        self._event = ""
        return sse


async def aiter_sse(lines: AsyncIterator[str]) -> AsyncIterator[ServerSentEvent]:
    decoder = SSEDecoder()
    async for line in lines:
        sse = decoder.feed(line.rstrip("\r\n"))
        if sse is not None:
            yield sse
    last = decoder.flush()
    if last is not None:
        yield last
