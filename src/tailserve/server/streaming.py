"""Server-sent events of a generation: the chat and completion chunks as SSE
(``chat_events``) and the response that carries them (``GenerationStream``), which aborts the
generation whenever the response ends before it did. The Responses API's stream
(``responses_stream.py``) reuses the response class."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from tailserve.engine.client import EngineDeadError
from tailserve.server.errors import engine_error, error_body
from tailserve.server.formatting import OpenAIFormatter
from tailserve.server.generation import Choice, Generation


async def chat_events(gen: Generation, first: list[Choice], rid: str, include_usage: bool,
                      fmt: OpenAIFormatter) -> AsyncIterator[str]:
    """A generation's SSE events from its first outputs on: the formatter's chunks (a
    choice's text held back while it may still become a stop string), the usage chunk when
    asked, an error event if the engine dies, then ``[DONE]``; the generation is aborted
    when the stream ends first (client gone: ``client_disconnect``, else ``server_error``)."""
    changed = first
    started: set[int] = set()
    # Why the stream ended early, if it did: a client gone cancels this task (or
    # closes the generator); anything else is a failure of ours.
    reason = "server_error"
    try:
        while True:
            deltas = []
            for c in sorted(changed, key=lambda c: c.index):
                d = gen.delta(c, holdback=True)
                if d.text or d.finish_reason or c.index not in started:
                    deltas.append(d)
            if deltas:
                chunk = fmt.chunk(rid, deltas, started)
                started.update(d.choice.index for d in deltas)
                if gen.done and not include_usage:
                    chunk["tailserve_timing"] = gen.ordered_choices()[0].timing
                yield sse(chunk)
            if gen.done:
                break
            changed = await gen.next_outputs()
        if include_usage:
            yield sse(fmt.usage_chunk(rid, chunk, gen))
    except EngineDeadError as exc:
        err = engine_error(f"the engine failed: {exc}")
        yield sse(error_body(err.message, err.type, None, err.code))
    except (asyncio.CancelledError, GeneratorExit):
        reason = "client_disconnect"
        raise
    finally:
        # Client gone or any failure: free the blocks, and record why.
        if not gen.done:
            gen.abort(reason)
    yield "data: [DONE]\n\n"


class GenerationStream(StreamingResponse):
    """A generation's SSE response that aborts the generation whenever the response ends
    before the generation did, including when its body never ran.

    Starlette iterates the body only after sending the response start, so cleanup inside the
    body generator is not enough: a server on ASGI spec 2.4 raises on sending to a client that
    has gone (Starlette turns it into ``ClientDisconnect``) before the generator is entered,
    and a generator never entered never runs its ``finally``; its engine requests would run
    on to max_tokens for nobody. ``abort`` finishes only what is still unfinished, so the
    body's own cleanup and this one never count a choice twice.
    """

    def __init__(
        self, content: AsyncIterator[str], gen: Generation, headers: dict[str, str]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.generation = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.generation.done:
                self.generation.abort("client_disconnect")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
