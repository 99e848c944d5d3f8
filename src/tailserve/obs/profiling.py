"""Profiling capture of the engine process (``POST /debug/profile?seconds=N``).

``ProfileCapture`` runs a ``torch.profiler`` trace for N seconds while the engine keeps
serving, then writes a Chrome trace (JSON; opens in Perfetto, ``chrome://tracing``) to the
given path. ``span(name)`` marks the phases of a step — ``schedule``, ``prepare_inputs``,
``forward``, ``sample``, ``update`` — as ``record_function`` ranges and, on CUDA, NVTX ranges
(for Nsight Systems). Outside a capture ``span`` returns the shared no-op ``NOOP``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

capturing = False  # a capture is running in this process
_cuda = False  # and its device is CUDA (NVTX ranges too)
NOOP = contextlib.nullcontext()


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named range of the current step (a no-op unless a capture is running)."""
    if not capturing:
        return NOOP
    return _range(name)


@contextlib.contextmanager
def _range(name: str) -> Iterator[None]:
    import torch

    if _cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if _cuda:
            torch.cuda.nvtx.range_pop()


class ProfileCapture:
    def __init__(self, path: str, seconds: float, device: str) -> None:
        import torch

        global capturing, _cuda
        self.path = path
        self.deadline = time.monotonic() + seconds
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        capturing, _cuda = True, device.startswith("cuda")

    def due(self) -> bool:
        return time.monotonic() >= self.deadline

    def finish(self) -> str:
        """Stop and write the trace; returns the path."""
        global capturing
        capturing = False
        self._prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        logger.info("profile written to %s", self.path)
        return self.path
