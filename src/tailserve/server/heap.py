"""The API process gives back the heap a large request took, once it is done with it.

Tokenizing a prompt of hundreds of kB (the byte bound lets ~670 kB through at an 8k context)
allocates tens of MB in the tokenizer (Rust, through malloc) and in the token-id lists; freed,
glibc keeps those pages in the arena of the thread that used them, so the process stays at its
high-water mark for good (measured: 380 -> 520 MB after eight such prompts, and kept). Two
bounds, both glibc's own knobs, applied from Python with ctypes (a no-op on other C
libraries):

- ``M_ARENA_MAX``: at most ``arena_max`` malloc arenas, set before the tokenize threads start,
  so each worker does not keep a private high-water mark of its own;
- ``malloc_trim(0)`` after the last large request in flight ends: the free pages of every
  arena go back to the OS. On a tokenize worker thread, off the event loop (ctypes releases the
  GIL); a few ms for a few hundred MB.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tailserve.glibc import glibc

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's malloc.h


class HeapTrimmer:
    """Counts large requests in flight; when the last one ends, trims the heap via ``run``
    (which runs a callable off the event loop)."""

    def __init__(
        self, large_bytes: int, arena_max: int | None, run: Callable[[Callable[[], Any]], Any]
    ) -> None:
        self.large_bytes = large_bytes
        self._run = run
        self._libc = glibc()
        self.active = 0
        self.trims = 0
        if self._libc is not None and arena_max is not None:
            self._libc.mallopt(_M_ARENA_MAX, arena_max)

    @property
    def available(self) -> bool:
        return self._libc is not None

    def started(self) -> None:
        self.active += 1

    def ended(self) -> None:
        self.active -= 1
        if self.active == 0 and self._libc is not None:
            self._run(self._trim)

    def _trim(self) -> None:
        assert self._libc is not None
        self._libc.malloc_trim(0)
        self.trims += 1


class TrimAfterLargeRequests:
    """ASGI: a request whose declared body is at least ``trimmer.large_bytes`` is counted by
    the trimmer while it runs. The edge (``middleware.py``) routes only such requests here;
    the check is repeated so that this wrapper is right on its own."""

    def __init__(self, app: Any, trimmer: HeapTrimmer) -> None:
        self.app = app
        self.trimmer = trimmer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.trimmer.available or not _is_large(
            scope["headers"], self.trimmer.large_bytes
        ):
            await self.app(scope, receive, send)
            return
        self.trimmer.started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.trimmer.ended()


def _is_large(headers: list[tuple[bytes, bytes]], large_bytes: int) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.isdigit() and int(value) >= large_bytes
    return False
