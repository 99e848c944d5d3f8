"""A lean HTTP/1.1 client for ``http://`` servers: the bench's default send/receive path.

Why not aiohttp here: at 50 requests/s the client idles ~20 ms between requests and its code
goes cold in the caches; aiohttp's per-request path (session, request and response objects,
header multidicts, stream readers, a task wake-up per read) then costs ~0.9 ms of TTFT at
P50 on a 2-core VM, against ~0.3 ms for loopback itself (benchmarks/notes/tools.md). Here:

- the whole request (request line, headers with this request's ``x-request-id``, JSON body)
  is built by ``prepare`` before the step's clock starts, so sending is one
  ``transport.write`` right after the send stamp;
- the response is parsed inside ``data_received`` (``bench/http11_conn.py``: status line,
  headers, chunked or Content-Length or read-to-close bodies) and the body goes straight to
  the shared ``SseParser`` with the stamp taken on entry to ``data_received``: no stream
  reader, no task wake-up between the socket and the clock;
- connections are kept alive in a small LIFO pool (the most recently used one is the
  warmest) with TCP_NODELAY, as aiohttp's are.

Failures are classified as ``StreamClient`` (aiohttp) classifies them, so a result does not
depend on which client ran: the HTTP status and the server's error type for non-200
responses, ``connection_refused`` / ``connection_error`` when connecting fails,
``server_disconnected`` when the connection ends before the response head,
``incomplete_response`` when it ends inside the body, ``timeout``, ``bad_json``,
``bad_response``. A request is retried in one case only: written to a pooled connection the
server had already closed, with nothing come back (no status line). llama-server closes its
connection after each streamed response though the response head says keep-alive, and the
next request, sent microseconds later, would otherwise fail as ``server_disconnected`` (7 of
16 one at a time, measured): that request was never read, so it is sent once more on a new
connection, its send stamp taken again.
"""

from __future__ import annotations

import asyncio
from time import perf_counter
from urllib.parse import urlsplit

import aiohttp

import tailserve
from tailserve.bench import BenchError
from tailserve.bench.client import (
    STREAM_PARSE_ERRORS,
    BenchClient,
    RequestResult,
    StreamClient,
    describe_stream_error,
)
from tailserve.bench.http11_conn import (
    Http11Connection,
    HTTPProtocolError,
    IncompleteResponse,
    ServerDisconnected,
)


class LeanStreamClient:
    """``StreamClient``'s interface over ``Http11Connection``s: one per target URL, with its
    pool."""

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
        self.pool: list[Http11Connection] = []

    def prepare(self, body: bytes, res: RequestResult) -> bytes:
        """The complete request, built before the clock starts: sending is one write."""
        return b"%sx-request-id: %s\r\nContent-Length: %d\r\n\r\n%s" % (
            self._head_prefix, res.request_id.encode("latin-1"), len(body), body)

    async def close(self) -> None:
        for conn in list(self.pool):
            conn.drop()
        self.pool.clear()

    async def _connect(self, deadline: float | None) -> Http11Connection:
        loop = asyncio.get_running_loop()
        coro = loop.create_connection(lambda: Http11Connection(self.pool), self.host, self.port)
        if deadline is None:
            _, conn = await coro
        else:
            async with asyncio.timeout_at(loop.time() + max(0.0, deadline - perf_counter())):
                _, conn = await coro
        return conn

    async def send(self, prepared: bytes, res: RequestResult, t0: float) -> None:
        silent = await self._send(prepared, res, t0, self._pooled())
        if silent and res.error_type == "server_disconnected":
            # The server had closed that pooled connection as the request went out: it read
            # nothing, answered nothing (llama-server closes after each streamed response,
            # though its head says keep-alive). Once more, on a new connection, stamped anew.
            res.error_type = res.error = None
            res.send_s = None
            await self._send(prepared, res, t0, None)

    def _pooled(self) -> Http11Connection | None:
        pool = self.pool
        while pool:  # LIFO: the most recently used connection is the warmest
            c = pool.pop()
            if not c.closed and c.transport is not None and not c.transport.is_closing():
                return c
        return None

    async def _send(self, prepared: bytes, res: RequestResult, t0: float,
                    conn: Http11Connection | None) -> bool:
        """One exchange; whether it went out on a pooled (reused) connection from which not
        one byte came back."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        pooled = conn
        timer: asyncio.TimerHandle | None = None
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
                    return False
                except OSError as exc:
                    res.error_type = "connection_error"
                    res.error = f"Cannot connect to host {self.host}:{self.port} [{exc}]"
                    return False
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
                conn.fail(asyncio.CancelledError())
            raise
        finally:
            if timer is not None:
                timer.cancel()
            res.end_s = perf_counter() - t0
        return pooled is not None and not pooled.received


def _expire(conn: Http11Connection, fut: asyncio.Future[None]) -> None:
    if conn.fut is fut and not fut.done():
        conn.fail(TimeoutError())


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
