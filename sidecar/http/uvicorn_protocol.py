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
and then its response. An idle connection that ends closes at once, as before.
"""

from __future__ import annotations

import socket
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHECKS_S = (0.02, 0.1, 0.3, 1.0, 3.0)  # after the probe: when to look for a reset


class HalfCloseHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._input_ended = False

    def eof_received(self) -> bool | None:
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:
            return None  # between requests: close, as uvicorn does
        self._input_ended = True
        if not cycle.response_started and cycle.scope.get("http_version") == "1.1":
            self.transport.write(_PROBE)
            for delay in _CHECKS_S:
                self.loop.call_later(delay, self._drop_if_reset)
        return True  # keep the transport open for the response

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
