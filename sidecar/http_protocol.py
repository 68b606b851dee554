"""The HTTP/1.1 protocol both apps are served with: uvicorn's, keeping a half-closed
connection open until its response is written.

A client may send its request and then shut its write side (``SHUT_WR``): an end of input,
not a goodbye. uvicorn's protocols return None from ``eof_received``, so asyncio closes the
transport there and a response that is not written yet is lost. Here the transport stays
open while a request is in progress and closes once its response is complete. TCP cannot
tell a half close from a full one without writing, so a request whose client went away for
good is noticed at its first write after that (a stream's next token) or runs to its end
(bounded by ``max_tokens``); an idle connection that ends closes at once, as before.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


class HalfCloseHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._input_ended = False

    def eof_received(self) -> bool | None:
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:
            return None  # between requests: close, as uvicorn does
        self._input_ended = True
        return True  # keep the transport open for the response

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._input_ended and not self.transport.is_closing():
            self.transport.close()  # nothing more can come in: no keep-alive wait
