"""A bound on how long a connection may take to send a request's headers.

uvicorn closes idle keep-alive connections but never one that is in the middle of sending its
headers: a client that sends a byte a second (slowloris) holds its connection, and a file
descriptor, for as long as it likes. ``header_timeout_protocol`` wraps uvicorn's HTTP
protocol class so that a connection whose request headers are not complete within
``timeout_s`` of its first byte (or of opening, for the first request) is answered 408 and
closed. A request whose headers are in is unaffected: its body and a long streamed response
take as long as they take.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

_BODY = (
    b'{"error":{"message":"the request headers were not complete in time",'
    b'"type":"invalid_request_error","param":null,"code":"header_timeout"}}'
)
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


def header_timeout_protocol(base: type[asyncio.Protocol], timeout_s: float) -> type[Any]:
    """``base`` (uvicorn's h11 or httptools protocol) with the header timeout.

    Both of uvicorn's protocols set ``self.cycle`` to a new object when a request's headers
    have been parsed, and call ``on_response_complete`` when its response is done; the timer
    runs from the connection's opening (or a new request's first byte) until the next new
    cycle appears.
    """

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._seen_cycle: object | None = None
            self._awaiting_headers = True

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers and self._header_timer is None:
                self._arm()  # the next request on a kept-alive connection begins
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if cycle is not None and cycle is not self._seen_cycle:
                self._seen_cycle = cycle
                self._awaiting_headers = False
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._awaiting_headers = True

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            loop = asyncio.get_running_loop()
            self._header_timer = loop.call_later(timeout_s, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            transport = getattr(self, "transport", None)
            if transport is None or transport.is_closing():
                return
            logger.debug("closing a connection whose headers took over %.1f s", timeout_s)
            try:
                transport.write(_REQUEST_TIMEOUT)
            finally:
                transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
