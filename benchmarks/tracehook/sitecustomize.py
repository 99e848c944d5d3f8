"""Which tailserve source files run while tracing is switched on (for trace_request.sh).

Loaded through ``PYTHONPATH`` into every process of a ``tailserve serve`` (the API process and
the engine process). It installs a ``sys.settrace`` hook that records the first *call* of any
Python function whose code lives under ``$TRACE_SRC`` (the ``src/tailserve/`` directory); line
events are not traced. SIGUSR1 clears the record and starts counting; SIGUSR2 stops and writes
the files, in the order they first ran, to ``$TRACE_OUT/trace-<pid>.txt``.

What it counts: files with at least one function (module body, method, property, closure,
generator step) executed in the window, and files of a frame that was already running when the
window opened (the engine's driver loop, entered once at start-up) as soon as one of its lines
runs in the window; a frame that only waits below the window (``cli.main`` under the event
loop) runs no line and does not count. A file whose only part in the window is a plain
dataclass (its ``__init__`` is generated, not in the file) or a constant does not count: that is
a definition a reader opens, not code that runs. With ``TRACE_FUNCS=1`` each line is
``file:function`` instead, for finding which call brings a file in; with ``TRACE_CALLS=1``
``caller -> callee`` file pairs (calls between two files under ``$TRACE_SRC``), for checking
that nothing calls back up a layer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

_ROOT = os.environ.get("TRACE_SRC", "")
_OUT = os.environ.get("TRACE_OUT", "/tmp")
_FUNCS = os.environ.get("TRACE_FUNCS", "") == "1"
_CALLS = os.environ.get("TRACE_CALLS", "") == "1"
_on = False
_seen: dict[str, int] = {}


def _trace(frame: FrameType, event: str, arg: Any) -> None:
    # Called on every function call in every thread; returning None skips line events.
    if _on and frame.f_code.co_filename.startswith(_ROOT):
        _record(frame)
        caller = frame.f_back
        if _CALLS and caller is not None and caller.f_code.co_filename.startswith(_ROOT):
            here = frame.f_code.co_filename.removeprefix(_ROOT)
            there = caller.f_code.co_filename.removeprefix(_ROOT)
            if here != there:
                _seen.setdefault(f"{there} -> {here}", len(_seen))


def _record(frame: FrameType) -> None:
    key = frame.f_code.co_filename.removeprefix(_ROOT)
    if _FUNCS:
        key = f"{key}:{frame.f_code.co_qualname}"
    _seen.setdefault(key, len(_seen))


def _lines(frame: FrameType, event: str, arg: Any) -> Any:
    # The local tracer of a frame that was running when the window opened.
    if _on and event == "line":
        _record(frame)
    return _lines


def _start(signum: int, frame: FrameType | None) -> None:
    global _on
    _seen.clear()
    _on = True
    # Calls made from here on are seen by _trace; frames already on a stack (a loop entered
    # before the window) count once a line of theirs runs.
    for top in sys._current_frames().values():
        f: FrameType | None = top
        while f is not None:
            if f.f_code.co_filename.startswith(_ROOT):
                f.f_trace = _lines
                f.f_trace_lines = True
            f = f.f_back


def _stop(signum: int, frame: FrameType | None) -> None:
    global _on
    _on = False
    with open(os.path.join(_OUT, f"trace-{os.getpid()}.txt"), "w") as fh:
        fh.writelines(f"{key}\n" for key in sorted(_seen, key=_seen.__getitem__))


if _ROOT:
    sys.settrace(_trace)
    threading.settrace(_trace)
    try:
        signal.signal(signal.SIGUSR1, _start)
        signal.signal(signal.SIGUSR2, _stop)
    except ValueError:  # not the main thread of an embedded interpreter: tracing stays off
        pass
