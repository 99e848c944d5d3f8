"""The edge: everything a request passes before FastAPI, in the order it passes it.

Under the ASGI app, on the connection: ``header_timeout_protocol`` bounds how long a request's
headers may take to arrive. uvicorn closes idle keep-alive connections but never one that is
in the middle of sending its headers: a client that sends a byte a second (slowloris) holds
its connection, and a file descriptor, for as long as it likes. The protocol answers 408 and
closes a connection whose request headers are not complete within ``timeout_s`` of its first
byte (or of opening, for the first request). A request whose headers are in is unaffected: its
body and a long streamed response take as long as they take.

Then one pure ASGI middleware (no per-request task or body copy), ``EdgeMiddleware``:

1. ``x-request-id``: echo the client's (if sane) or make one; on every response.
2. Header size: more than ``max_header_bytes`` of headers -> 431.
3. Auth: with an API key, every path except ``/health`` and ``/metrics`` needs
   ``Authorization: Bearer KEY`` (constant-time compare). The check uses the path the router
   will route on (``scope["path"]``), so no Host header, query or encoding trick reaches a
   protected route without the key: anything not exactly an exempt path is protected.
   ``/dashboard`` and ``/dashboard/*`` alone also take ``?key=KEY``: a browser cannot put a
   header on a link or on an ``EventSource``.
4. Body size: a ``Content-Length`` over ``max_request_bytes`` -> 413 before reading; a chunked
   body is counted as it arrives and cut off with 413 at the limit.
5. A declared body of at least ``large[0]`` bytes goes on to ``large[1]`` (the same chain with
   the heap trimmer's count, ``heap.py``); every other request skips that hop.

Behind it, ``SheddingMiddleware``: refusals before the body is read, the gate every
generation request passes first. A burst far above capacity is mostly refusals, and a refusal
that goes through the whole FastAPI stack (routing, reading and validating the JSON body,
tokenizing, fanning out ``n``) before it finds the server full costs what an admitted request
costs to prepare. Here, as pure ASGI ahead of FastAPI (behind the edge's auth and size
checks), a ``POST`` to ``/v1/completions``, ``/v1/chat/completions`` or ``/v1/responses`` is
answered at once when it can only be refused: 503 while the engine is gone or the server
drains, 429 when the requests in flight plus those already past the gate fill
``max_num_seqs + max_queue_len``.
The body is never read.

A request let in holds a ticket (one sequence's place) until it is admitted or refused by
``ServerContext.admit`` or ends any other way; so a burst lets in at most the capacity, even
though none of it is in flight until its prompt is tokenized. Admission proper, with the
request's real size, stays in ``admit``; the gate's own state and answers are
``ServerContext.early_refusal`` / ``take_ticket`` / ``return_ticket``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from tailserve.server.errors import APIError, error_body, error_response
from tailserve.server.tenants import DEFAULT_TENANT, Tenant, check_tenant_name

if TYPE_CHECKING:
    from tailserve.server.context import ServerContext

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

AUTH_EXEMPT_PATHS = frozenset({"/health", "/metrics"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
DASHBOARD_PATH = "/dashboard"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


# ------------------------------------------------------------ the connection: header timeout
_HEADER_TIMEOUT_BODY = (
    b'{"error":{"message":"the request headers were not complete in time",'
    b'"type":"invalid_request_error","param":null,"code":"header_timeout"}}'
)
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_HEADER_TIMEOUT_BODY)).encode()
    + b"\r\n\r\n" + _HEADER_TIMEOUT_BODY
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


# ---------------------------------------------------------------- the ASGI edge
class EdgeMiddleware:
    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_request_bytes: int,
        max_header_bytes: int,
        on_reject: Callable[[str], None] = lambda reason: None,
        large: tuple[int, Any] | None = None,
        tenants: dict[bytes, Tenant] | None = None,
        tenant_header: str | None = None,
    ) -> None:
        self.app = app
        self.large = large
        self.api_key = api_key.encode() if api_key else None
        # --api-keys: a key names its tenant (looked up by the key's SHA-256 digest).
        self.tenants = tenants
        # A trusted proxy names tenants: those in the keys file keep their limits.
        self._tenants_by_name = {t.name: t for t in (tenants or {}).values()}
        self.tenant_header = tenant_header.lower().encode() if tenant_header else None
        self.max_request_bytes = max_request_bytes
        self.max_header_bytes = max_header_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = None
        auth = b""
        content_length = None
        header_bytes = 0
        named_tenant: bytes | None = None
        for name, value in headers:
            header_bytes += len(name) + len(value) + 4
            if name == b"x-request-id":
                rid = value.decode("latin-1")
            elif name == b"authorization":
                auth = value
            elif name == b"content-length":
                content_length = value
            elif name == self.tenant_header:
                named_tenant = value
        if rid is None or not _SANE_ID.match(rid):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        rid_header = (b"x-request-id", rid.encode())

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *[(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"],
                    rid_header,
                ]
            await send(message)

        if header_bytes > self.max_header_bytes:
            self.on_reject("too_large")
            await _error(send_with_id, 431, f"request headers total {header_bytes} bytes; the "
                         f"limit is {self.max_header_bytes}", "invalid_request_error",
                         "headers_too_large")
            return
        tenant: Tenant | None = None
        if (self.api_key is not None or self.tenants is not None) \
                and scope["path"] not in AUTH_EXEMPT_PATHS:
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            path = scope["path"]
            if not given and (path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")):
                given = _query_key(scope.get("query_string", b""))
            if self.tenants is not None:
                tenant = self.tenants.get(hashlib.sha256(given).digest())
            if tenant is None and self.api_key is not None \
                    and hmac.compare_digest(given, self.api_key):
                tenant = Tenant(DEFAULT_TENANT)
            if tenant is None:
                self.on_reject("unauthorized")
                await _error(send_with_id, 401, "a valid API key is required (Authorization: "
                             "Bearer KEY)", "authentication_error", "invalid_api_key",
                             extra=[(b"www-authenticate", b"Bearer")])
                return
        if named_tenant is not None and self.tenant_header is not None:
            # A proxy the operator trusts names the tenant; its keys-file limits still apply.
            try:
                tenant_name = check_tenant_name(named_tenant.decode("latin-1"),
                                                self.tenant_header.decode())
            except APIError as exc:
                await _error(send_with_id, exc.status, exc.message, exc.type,
                             exc.code or "invalid_tenant")
                return
            tenant = self._tenants_by_name.get(tenant_name) or Tenant(tenant_name)
        scope["state"]["tenant"] = tenant
        limit = self.max_request_bytes
        app = self.app
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                declared = None
            if declared is not None and declared > limit:
                self.on_reject("too_large")
                await _error(send_with_id, 413, f"the request body is {declared} bytes; the "
                             f"limit is {limit}", "invalid_request_error", "request_too_large")
                return
            if declared is not None and self.large is not None and declared >= self.large[0]:
                app = self.large[1]
        received = 0
        started = False
        too_large = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal received, too_large
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # The app sees the client go away; its answer is replaced by a 413 below.
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if too_large:
                return
            if message["type"] == "http.response.start":
                started = True
            await send_with_id(message)

        try:
            await app(scope, counting_receive, tracking_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            self.on_reject("too_large")
            await _error(send_with_id, 413, f"the request body exceeds {limit} bytes",
                         "invalid_request_error", "request_too_large")


class SheddingMiddleware:
    def __init__(self, app: Any, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        ctx = self.ctx
        tenant: Tenant | None = scope.get("state", {}).get("tenant")  # EdgeMiddleware's
        refusal = ctx.early_refusal(tenant)
        if refusal is not None:
            ctx.metrics.on_rejected("queue_full" if refusal.status == 429
                                    else refusal.code or "unavailable",
                                    tenant.name if tenant is not None else None)
            await error_response(refusal)(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        ctx.take_ticket(state)
        try:
            await self.app(scope, receive, send)
        finally:
            ctx.return_ticket(state)


def _query_key(query_string: bytes) -> bytes:
    for value in parse_qs(query_string.decode("latin-1")).get("key", []):
        return value.encode()
    return b""


async def _error(
    send: Send,
    status: int,
    message: str,
    type: str,
    code: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(error_body(message, type, None, code)).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *(extra or []),
        ],
    })
    await send({"type": "http.response.body", "body": body})
