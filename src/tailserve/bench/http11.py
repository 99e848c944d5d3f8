"""A lean HTTP/1.1 client for ``http://`` servers: the bench's default send/receive path.

Why not aiohttp here: at 50 requests/s the client idles ~20 ms between requests and its code
goes cold in the caches; aiohttp's per-request path (session, request and response objects,
header multidicts, stream readers, a task wake-up per read) then costs ~0.9 ms of TTFT at
P50 on a 2-core VM, against ~0.3 ms for loopback itself (benchmarks/notes/tools.md). Here:

- the whole request (request line, headers with this request's ``x-request-id``, JSON body)
  is built by ``prepare`` before the step's clock starts, so sending is one
  ``transport.write`` right after the send stamp;
- the response is parsed inside ``data_received`` (status line, headers, chunked or
  Content-Length or read-to-close bodies) and the body goes straight to the shared
  ``SseParser`` with the stamp taken on entry to ``data_received``: no stream reader, no
  task wake-up between the socket and the clock;
- connections are kept alive in a small LIFO pool (the most recently used one is the
  warmest) with TCP_NODELAY, as aiohttp's are.

Failures are classified as ``StreamClient`` (aiohttp) classifies them, so a result does not
depend on which client ran: the HTTP status and the server's error type for non-200
responses, ``connection_refused`` / ``connection_error`` when connecting fails,
``server_disconnected`` when the connection ends before the response head,
``incomplete_response`` when it ends inside the body, ``timeout``, ``bad_json``,
``bad_response``. Like aiohttp for a POST, a request is never retried.
"""

from __future__ import annotations

import asyncio
import socket
from time import perf_counter
from typing import cast
from urllib.parse import urlsplit

import aiohttp

import tailserve
from tailserve.bench import BenchError
from tailserve.bench.client import (
    _ERROR_BODY_LIMIT,
    STREAM_PARSE_ERRORS,
    BenchClient,
    RequestResult,
    SseParser,
    StreamClient,
    describe_http_error,
    describe_stream_error,
)

_MAX_HEAD = 64 << 10  # a response head larger than this is not an HTTP server's


class ServerDisconnected(Exception):
    """The connection ended before the response head was complete."""


class IncompleteResponse(Exception):
    """The connection ended inside the response body (chunked or Content-Length)."""


class HTTPProtocolError(Exception):
    """Bytes that are not an HTTP/1.x response."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying one exchange at a time (no pipelining)."""

    def __init__(self, pool: list[_Conn]) -> None:
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
            self._drop()
            return
        try:
            self._receive(data, now)
        except Exception as exc:  # every failure goes to the waiting send()
            self._fail(exc)

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
            self._fail(ServerDisconnected(
                "the server closed the connection before the response was complete"
                + (f" ({exc})" if exc else "")))
        elif self.framing == "close" and exc is None:
            self._complete(perf_counter())  # the body was "until the connection closes"
        else:
            self._fail(IncompleteResponse(
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
            self._drop()
        fut.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        fut = self.fut
        self.fut = self.res = self.sse = None
        self._drop()
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _drop(self) -> None:
        self.closed = True
        if self in self.pool:
            self.pool.remove(self)
        if self.transport is not None:
            self.transport.abort()  # mid-response: nothing to flush, nothing to wait for


class LeanStreamClient:
    """``StreamClient``'s interface over ``_Conn``: one per target URL, with its pool."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float | None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the lean HTTP/1.1 client speaks plain http://, not {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_header = parts.netloc.rsplit("@", 1)[-1]
        fixed = {"Host": host_header, "User-Agent": f"tailserve-bench/{tailserve.__version__}",
                 "Accept": "*/*", **headers, "Content-Type": "application/json"}
        self._head_prefix = (f"POST {path} HTTP/1.1\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in fixed.items())).encode("latin-1")
        self.timeout_s = timeout_s
        self.pool: list[_Conn] = []

    def prepare(self, body: bytes, res: RequestResult) -> bytes:
        """The complete request, built before the clock starts: sending is one write."""
        return b"%sx-request-id: %s\r\nContent-Length: %d\r\n\r\n%s" % (
            self._head_prefix, res.request_id.encode("latin-1"), len(body), body)

    async def close(self) -> None:
        for conn in list(self.pool):
            conn._drop()
        self.pool.clear()

    async def _connect(self, deadline: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        coro = loop.create_connection(lambda: _Conn(self.pool), self.host, self.port)
        if deadline is None:
            _, conn = await coro
        else:
            async with asyncio.timeout_at(loop.time() + max(0.0, deadline - perf_counter())):
                _, conn = await coro
        return conn

    async def send(self, prepared: bytes, res: RequestResult, t0: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        conn: _Conn | None = None
        timer: asyncio.TimerHandle | None = None
        pool = self.pool
        while pool:  # LIFO: the most recently used connection is the warmest
            c = pool.pop()
            if not c.closed and c.transport is not None and not c.transport.is_closing():
                conn = c
                break
        # The send stamp: right before the write on a pooled connection; before connecting
        # when there is none, because a user's request would pay for the connect too (as
        # with aiohttp and vLLM's client).
        st = 0.0
        try:
            if conn is None:
                st = perf_counter()
                res.send_s = st - t0
                try:
                    conn = await self._connect(
                        None if self.timeout_s is None else st + self.timeout_s)
                except TimeoutError:
                    raise  # an OSError too, but it is the --timeout's, reported as such
                except ConnectionRefusedError as exc:
                    res.error_type = "connection_refused"
                    res.error = f"Cannot connect to host {self.host}:{self.port} [{exc}]"
                    return
                except OSError as exc:
                    res.error_type = "connection_error"
                    res.error = f"Cannot connect to host {self.host}:{self.port} [{exc}]"
                    return
            assert conn.transport is not None
            # Everything set up before the stamp, so that only the write follows it, and
            # nothing but the await after it: until this process sleeps the responder may be
            # waiting for the CPU it is on (2 cores, shared).
            sse = conn.start(res, fut)
            if self.timeout_s is not None:
                timer = loop.call_at(loop.time() + (self.timeout_s if st == 0.0 else max(
                    0.0, st + self.timeout_s - perf_counter())), _expire, conn, fut)
            if res.send_s is None:
                st = perf_counter()
                res.send_s = st - t0
            sse.st = sse.last = sse.now = st
            conn.transport.write(prepared)
            await fut
        except TimeoutError:
            res.error_type = "timeout"
            res.error = f"no complete response within --timeout {self.timeout_s:g} s"
        except ServerDisconnected as exc:
            res.error_type = "server_disconnected"
            res.error = str(exc)
        except IncompleteResponse as exc:
            res.error_type = "incomplete_response"
            res.error = str(exc)
        except HTTPProtocolError as exc:
            res.error_type = "client_error"
            res.error = f"{type(exc).__name__}: {exc}"
        except STREAM_PARSE_ERRORS as exc:
            res.error_type, res.error = describe_stream_error(exc)
        except BaseException:
            # Cancelled (Ctrl-C) mid-exchange: the rest of this response must not be read
            # as the next request's.
            if conn is not None and conn.fut is fut:
                conn._fail(asyncio.CancelledError())
            raise
        finally:
            if timer is not None:
                timer.cancel()
            res.end_s = perf_counter() - t0


def _expire(conn: _Conn, fut: asyncio.Future[None]) -> None:
    if conn.fut is fut and not fut.done():
        conn._fail(TimeoutError())


HTTP_CLIENTS = ("lean", "aiohttp")


def make_client(kind: str, url: str, headers: dict[str, str], timeout_s: float | None,
                session: aiohttp.ClientSession) -> BenchClient:
    """``--http-client``: ``lean`` (default) for http:// URLs, aiohttp for https:// (TLS is
    aiohttp's) or when asked for."""
    if kind not in HTTP_CLIENTS:
        raise BenchError(f"--http-client must be lean or aiohttp, got {kind!r}")
    if kind == "lean" and url.startswith("http://"):
        return LeanStreamClient(url, headers, timeout_s)
    return StreamClient(session, url, headers, timeout_s)
