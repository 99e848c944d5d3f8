"""glibc's heap knobs (``malloc_trim``, ``mallopt``) through ctypes, looked up once.

Both processes give freed heap back to the OS with them: the engine each time it goes idle
(``engine/process.py``), the API process after large requests (``server/heap.py``). The lookup
is cached because ``ctypes.util.find_library`` runs ``ldconfig -p`` in a child process
(~1.4 ms), and a single stream's engine goes idle after every request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def glibc() -> Any | None:
    """The C library when it is glibc (it has ``malloc_trim`` and ``mallopt``), else None
    (musl has neither): callers then skip the trim, a no-op on such systems."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    return libc
