"""HeapTrimmer / TrimAfterLargeRequests: the heap is trimmed once the last large request in
flight ends, never for small ones (glibc's malloc_trim, for real; the runner is recorded)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tailserve.server.heap import HeapTrimmer, TrimAfterLargeRequests


def recording_trimmer() -> tuple[HeapTrimmer, list[Callable[[], Any]]]:
    queued: list[Callable[[], Any]] = []
    trimmer = HeapTrimmer(1000, arena_max=None, run=queued.append)
    if not trimmer.available:
        pytest.skip("not glibc: no malloc_trim")
    return trimmer, queued


def test_trims_after_the_last_large_request_ends() -> None:
    trimmer, queued = recording_trimmer()
    trimmer.started()
    trimmer.started()
    trimmer.ended()
    assert queued == []  # one large request still running
    trimmer.ended()
    assert len(queued) == 1
    queued[0]()  # malloc_trim(0) itself
    assert trimmer.trims == 1 and trimmer.active == 0


@pytest.mark.parametrize(("headers", "large"), [
    ([(b"content-length", b"1000")], True),
    ([(b"host", b"x"), (b"content-length", b"999")], False),
    ([(b"content-length", b"nonsense")], False),
    ([], False),  # chunked or no body
])
def test_only_declared_large_bodies_count(
    headers: list[tuple[bytes, bytes]], large: bool
) -> None:
    trimmer, queued = recording_trimmer()
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(trimmer.active)

    async def call() -> None:
        await TrimAfterLargeRequests(app, trimmer)({"type": "http", "headers": headers},
                                                   None, None)

    asyncio.run(call())
    assert seen == [1 if large else 0]
    assert len(queued) == (1 if large else 0)


def test_a_failing_request_still_ends() -> None:
    trimmer, queued = recording_trimmer()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    wrapped = TrimAfterLargeRequests(app, trimmer)
    with pytest.raises(RuntimeError):
        asyncio.run(wrapped({"type": "http", "headers": [(b"content-length", b"5000")]},
                            None, None))
    assert trimmer.active == 0 and len(queued) == 1


def test_engine_trims_without_looking_libc_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine trims its heap each time it goes idle (once per request of a single stream):
    glibc is looked up once, since find_library runs ldconfig in a child process (~1.4 ms)."""
    import ctypes.util

    from tailserve import glibc
    from tailserve.engine import process

    calls = []
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: calls.append(name) or real(name))
    glibc.glibc.cache_clear()
    try:
        for _ in range(3):
            process._trim_heap()
        assert calls == ["c"]
    finally:
        glibc.glibc.cache_clear()
