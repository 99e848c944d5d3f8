"""One keep-alive HTTP/1.1 connection of the bench's lean client (``bench/http11.py``), as an
asyncio ``Protocol`` carrying one exchange at a time: the response is parsed as its bytes
arrive in ``data_received`` (status line, headers; chunked, Content-Length or read-to-close
bodies; 1xx interim responses skipped) and the body goes straight to the request's
``SseParser`` with the stamp taken on entry, or, for a non-200 status, to a bounded error body.

The exchange ends on the waiting future: its result on a complete response (the connection
back in the pool when it may be kept alive), or the exception that classifies the failure
(``ServerDisconnected`` before the head, ``IncompleteResponse`` inside the body,
``HTTPProtocolError`` for bytes that are not HTTP/1.x).
"""

from __future__ import annotations

import asyncio
import socket
from time import perf_counter
from typing import cast

from tailserve.bench.client import (
    _ERROR_BODY_LIMIT,
    RequestResult,
    SseParser,
    describe_http_error,
)

_MAX_HEAD = 64 << 10  # a response head larger than this is not an HTTP server's


class ServerDisconnected(Exception):
    """The connection ended before the response head was complete."""


class IncompleteResponse(Exception):
    """The connection ended inside the response body (chunked or Content-Length)."""


class HTTPProtocolError(Exception):
    """Bytes that are not an HTTP/1.x response."""


class Http11Connection(asyncio.Protocol):
    """One keep-alive connection carrying one exchange at a time (no pipelining)."""

    def __init__(self, pool: list[Http11Connection]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.fut: asyncio.Future[None] | None = None
        self.res: RequestResult | None = None
        self.sse: SseParser | None = None
        self.buf = b""
        self.head_done = False
        self.keep_alive = True
        # Body framing: "chunked", "length" (self.remaining bytes), "close" (until EOF)
        self.framing = "close"
        self.remaining = 0
        self.chunk_left = 0  # bytes of the current chunk's data still to come (+2 for CRLF)
        self.in_trailers = False
        self.error_body: bytearray | None = None
        self.reason = ""
        self.received = False  # any byte of this exchange's response (http11.py's one retry)

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small writes must leave at once: Nagle would hold a request for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        now = perf_counter()  # first thing: the moment this read reached the client
        if self.fut is None or self.fut.done():
            # Bytes on an idle connection (or after a failure): not ours to interpret.
            self.drop()
            return
        self.received = True
        try:
            self._receive(data, now)
        except Exception as exc:  # every failure goes to the waiting send()
            self.fail(exc)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.pool:
            self.pool.remove(self)
        fut = self.fut
        if fut is None or fut.done():
            return
        if not self.head_done:
            self.fail(ServerDisconnected(
                "the server closed the connection before the response was complete"
                + (f" ({exc})" if exc else "")))
        elif self.framing == "close" and exc is None:
            self._complete(perf_counter())  # the body was "until the connection closes"
        else:
            self.fail(IncompleteResponse(
                "Response payload is not completed: the connection closed inside the body"
                + (f" ({exc})" if exc else "")))

    # ---- one exchange
    def start(self, res: RequestResult, fut: asyncio.Future[None]) -> SseParser:
        """A new exchange; the caller stamps the parser's ``st`` just before the write."""
        self.fut, self.res = fut, res
        self.sse = sse = SseParser(res, 0.0)
        self.buf = b""
        self.head_done = False
        self.error_body = None
        self.in_trailers = False
        self.chunk_left = 0
        self.received = False
        return sse

    def _receive(self, data: bytes, now: float) -> None:
        if not self.head_done:
            buf = self.buf + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise HTTPProtocolError("response head larger than 64 KiB")
                self.buf = buf
                return
            data = buf[end + 4:]
            self.buf = b""
            if not self._head(buf[:end]):
                # 1xx interim response: the real one follows on the same connection.
                if data:
                    self._receive(data, now)
                return
            if self.framing == "length" and self.remaining == 0:
                self._complete(now)
                return
            if not data:
                return
        if self.framing == "chunked":
            self._chunked(data, now)
        elif self.framing == "length":
            if len(data) >= self.remaining:
                # Anything after the body would be an unasked-for response: dropped with
                # the connection below (keep_alive is cleared).
                if len(data) > self.remaining:
                    self.keep_alive = False
                self._body(data[:self.remaining], now)
                self.remaining = 0
                self._complete(now)
            else:
                self.remaining -= len(data)
                self._body(data, now)
        else:
            self._body(data, now)

    def _head(self, head: bytes) -> bool:
        """Parse the status line and headers; False for a 1xx interim response."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HTTPProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return False
        self.reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        http10 = parts[0] == b"HTTP/1.0"
        length: int | None = None
        chunked = False
        conn_header = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    raise HTTPProtocolError(f"bad Content-Length: {value!r}") from None
            elif name == b"transfer-encoding":
                chunked = value.strip().lower().endswith(b"chunked")
            elif name == b"connection":
                conn_header = value.strip().lower()
        assert self.res is not None
        self.res.status = status
        self.head_done = True
        self.keep_alive = (b"keep-alive" in conn_header) if http10 else (
            b"close" not in conn_header)
        if chunked:  # RFC 9112 6.3: chunked wins over a Content-Length
            self.framing = "chunked"
        elif length is not None:
            self.framing, self.remaining = "length", length
        elif status in (204, 304):
            self.framing, self.remaining = "length", 0
        else:
            self.framing = "close"
            self.keep_alive = False
        if status != 200:
            self.error_body = bytearray()
        return True

    def _chunked(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        pos, n = 0, len(buf)
        body: list[bytes] = []
        while pos < n:
            left = self.chunk_left
            if left > 2:  # inside a chunk's data
                take = min(left - 2, n - pos)
                body.append(buf[pos:pos + take])
                pos += take
                self.chunk_left -= take
                continue
            if left > 0:  # the CRLF after a chunk's data
                if n - pos < left:
                    break
                if buf[pos:pos + left] != b"\r\n"[2 - left:]:
                    raise IncompleteResponse("malformed chunked body: no CRLF after a chunk")
                pos += left
                self.chunk_left = 0
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = buf[pos:eol]
            pos = eol + 2
            if self.in_trailers:
                if not line:  # the empty line that ends the message
                    self.buf = b""
                    if pos < n:
                        self.keep_alive = False
                    if body:
                        self._body(b"".join(body), now)
                    self._complete(now)
                    return
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise IncompleteResponse(f"malformed chunk size line: {line[:40]!r}") from None
            if size == 0:
                self.in_trailers = True
            else:
                self.chunk_left = size + 2
        self.buf = buf[pos:]
        if body:
            self._body(b"".join(body), now)

    def _body(self, data: bytes, now: float) -> None:
        if self.error_body is not None:
            room = _ERROR_BODY_LIMIT - len(self.error_body)
            if room > 0:
                self.error_body += data[:room]
        else:
            assert self.sse is not None
            self.sse.feed(data, now)

    def _complete(self, now: float) -> None:
        res, fut = self.res, self.fut
        assert res is not None and fut is not None and self.sse is not None
        if self.error_body is not None:
            assert res.status is not None
            res.error_type, res.error = describe_http_error(
                res.status, bytes(self.error_body), self.reason)
        else:
            # E2EL stays at the last read that carried body bytes (the SSE parser's "now"),
            # as with aiohttp, which never shows the client the bare end-of-body marker.
            self.sse.finish()
        self.fut = self.res = self.sse = None
        self.error_body = None
        if self.keep_alive and not self.closed:
            self.pool.append(self)
        else:
            self.drop()
        fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        fut = self.fut
        self.fut = self.res = self.sse = None
        self.drop()
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def drop(self) -> None:
        self.closed = True
        if self in self.pool:
            self.pool.remove(self)
        if self.transport is not None:
            self.transport.abort()  # mid-response: nothing to flush, nothing to wait for
