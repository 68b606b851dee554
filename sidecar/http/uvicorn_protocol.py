"""The HTTP/1.1 protocol both apps are served with: uvicorn's, keeping a half-closed
connection open until its response is written.

A client may send its request and then shut its write side (``SHUT_WR``): an end of input,
not a goodbye. uvicorn's protocols return None from ``eof_received``, so asyncio closes the
transport there and a response that is not written yet is lost. Here the transport stays
open while a request is in progress and closes once its response is complete.

TCP cannot tell a half close from a full one without writing. So at the end of input, when
the response has not started, an HTTP/1.1 client is sent an interim ``100 Continue`` (every
HTTP/1.1 client must skip 1xx responses): a client that is gone for good answers it with a
reset, which the socket then reports; the connection is dropped and the app sees
``http.disconnect`` (its request is aborted) as before. A half-closed client reads the 100
and then its response. An idle connection that ends closes at once, as before. An event
stream has started at once (its headers go before the request is even queued), so there the
probe is an SSE comment (``:``, a line every SSE reader skips) in a chunk of its own: a stream
whose client left while it waited in the queue is aborted then, not after its prefill, when
its first token would meet the reset.

Slow clients (with uvicorn's httptools parser, the one ``uvicorn[standard]`` brings): a
connection must finish a request's headers within ``HEADERS_TIMEOUT_S`` of opening (or of
the request's first byte on a kept-alive one), and its body within ``BODY_TIMEOUT_S`` of the
headers; otherwise it is closed (the app sees ``http.disconnect``). uvicorn holds a
connection that never sends a byte, or trickles its headers, for as long as the client likes:
enough of them used up the process's file descriptors.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: h11, whose parser calls none of the hooks below
    HttpToolsProtocol = None

_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
_STREAM_PROBE = b"2\r\n:\n\r\n"  # a chunk holding an SSE comment line
_CHECKS_S = (0.02, 0.1, 0.3, 1.0, 3.0)  # after the probe: when to look for a reset
HEADERS_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 120.0  # a 4 MiB body at 35 KB/s
_DEADLINES = HttpToolsProtocol is not None and issubclass(AutoHTTPProtocol, HttpToolsProtocol)


class HalfCloseHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._input_ended = False
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm(HEADERS_TIMEOUT_S, self._headers_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(HEADERS_TIMEOUT_S, self._headers_too_slow)  # a kept-alive one's next request

    def on_headers_complete(self) -> None:
        self._arm(BODY_TIMEOUT_S, self._body_too_slow)
        super().on_headers_complete()
        cycle = self.cycle
        send = cycle.send  # the app is handed cycle.send when its task starts, after this

        async def noting_event_streams(message: Any) -> None:
            if message["type"] == "http.response.start":
                cycle.event_stream = any(
                    name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ())
                )
            await send(message)

        cycle.send = noting_event_streams

    def on_message_complete(self) -> None:
        self._arm(None)
        super().on_message_complete()

    def _arm(self, seconds: float | None, then: Any = None) -> None:
        """Call ``then`` in ``seconds`` unless re-armed or disarmed (None) first."""
        if not _DEADLINES:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, then)

    def _headers_too_slow(self) -> None:
        self._deadline = None
        cycle = self.cycle  # during the next request's headers, still the previous request's
        if cycle is not None and not cycle.response_complete:
            return  # a pipelined request waits on our response, not the client on its headers
        self._close()

    def _body_too_slow(self) -> None:
        self._deadline = None
        if not self.pipeline:  # a pipelined request's body is not read until its turn
            self._close()

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def eof_received(self) -> bool | None:
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:
            return None  # between requests: close, as uvicorn does
        self._input_ended = True
        if not cycle.response_started and cycle.scope.get("http_version") == "1.1":
            self._probe(_PROBE)
        elif getattr(cycle, "event_stream", False) and cycle.chunked_encoding:
            self._probe(_STREAM_PROBE)
        return True  # keep the transport open for the response

    def _probe(self, data: bytes) -> None:
        """Write ``data``, which a live client skips, and then look for the reset of one that
        is gone."""
        self.transport.write(data)
        for delay in _CHECKS_S:
            self.loop.call_later(delay, self._drop_if_reset)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._input_ended and not self.transport.is_closing():
            self.transport.close()  # nothing more can come in: no keep-alive wait

    def _drop_if_reset(self) -> None:
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()  # the client is gone: connection_lost -> http.disconnect
