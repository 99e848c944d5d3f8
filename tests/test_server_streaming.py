"""``GenerationStream``: a streamed generation is aborted whenever its response ends first,
even when Starlette never started the body (ASGI spec 2.4: sending to a client that is gone
raises before the body is entered; a body never entered never runs its own cleanup)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from tailserve.server.streaming import GenerationStream


class RecordingGeneration:
    """Stands in for ``Generation`` (its ``done`` and ``abort``): the unit here is the response."""

    def __init__(self) -> None:
        self.done = False
        self.aborts: list[str | None] = []

    def abort(self, reason: str | None) -> None:
        self.aborts.append(reason)
        self.done = True


def body(gen: RecordingGeneration, chunks: int, entered: list[bool]) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        entered.append(True)
        for i in range(chunks):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0)
        gen.done = True  # the generation's last output was streamed
    return events()


def scope(spec_version: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
            "method": "POST", "path": "/v1/completions", "headers": []}


def test_a_body_never_started_still_aborts_the_generation() -> None:
    """Spec 2.4: the send of the response start raises (the client is gone), so the body is
    never entered; the generation is aborted once, as a client disconnect."""
    gen, entered = RecordingGeneration(), []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("client gone")

    response = GenerationStream(body(gen, 3, entered), gen, headers={})  # type: ignore[arg-type]
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope("2.4"), receive, send))
    assert entered == []
    assert gen.aborts == ["client_disconnect"]


def test_a_client_gone_at_the_start_aborts_once() -> None:
    """Spec 2.3 (uvicorn's): the disconnect is already waiting when the response starts."""
    gen, entered = RecordingGeneration(), []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    response = GenerationStream(body(gen, 1000, entered), gen, headers={})  # type: ignore[arg-type]
    asyncio.run(response(scope("2.3"), receive, send))
    assert gen.aborts == ["client_disconnect"]
    assert len(sent) < 1000


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_stream_that_ends_whole_aborts_nothing(spec_version: str) -> None:
    gen, entered = RecordingGeneration(), []
    sent: list[dict[str, Any]] = []
    more = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await more.wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    response = GenerationStream(body(gen, 3, entered), gen, headers={})  # type: ignore[arg-type]
    asyncio.run(response(scope(spec_version), receive, send))
    assert gen.aborts == []
    bodies = [m.get("body") for m in sent[1:]]
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
