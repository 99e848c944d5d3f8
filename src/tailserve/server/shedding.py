"""Refusals before the body is read: the gate every generation request passes first.

A burst far above capacity is mostly refusals, and a refusal that goes through the whole
FastAPI stack (routing, reading and validating the JSON body, tokenizing, fanning out ``n``)
before it finds the server full costs what an admitted request costs to prepare. Here, as
pure ASGI ahead of FastAPI (behind the edge's auth and size checks), a ``POST`` to
``/v1/completions`` or ``/v1/chat/completions`` is answered at once when it can only be
refused: 503 while the engine is gone or the server drains, 429 when the requests in flight
plus those already past the gate fill ``max_num_seqs + max_queue_len``. The body is never read.

A request let in holds a ticket (one sequence's place) until it is admitted or refused by
``ServerContext.admit`` or ends any other way; so a burst lets in at most the capacity, even
though none of it is in flight until its prompt is tokenized. Admission proper, with the
request's real size, stays in ``admit``.
"""

from __future__ import annotations

from typing import Any

from tailserve.server.context import ServerContext
from tailserve.server.errors import error_response

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class SheddingMiddleware:
    def __init__(self, app: Any, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        ctx = self.ctx
        refusal = ctx.early_refusal()
        if refusal is not None:
            ctx.metrics.on_rejected("queue_full" if refusal.status == 429
                                    else refusal.code or "unavailable")
            await error_response(refusal)(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        ctx.take_ticket(state)
        try:
            await self.app(scope, receive, send)
        finally:
            ctx.return_ticket(state)
