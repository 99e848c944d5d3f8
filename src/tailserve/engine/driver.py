"""The one engine-loop driver: poll for inputs, apply them, then step or heartbeat.

Both hosts of an ``EngineLoop`` run it: the engine process (inputs from a ZMQ socket, stops
when its parent dies) and ``InprocEngineClient`` (inputs from a thread-safe queue). Only how
inputs arrive and how the host notices it is orphaned differ; they come in as two callables::

    while True:
        inputs = wait_for_inputs(0 if busy else HEARTBEAT_S)
        if Shutdown in inputs: return 0
        if parent_gone(): return 0
        if busy: step (model failure: return 1)   else: heartbeat if HEARTBEAT_S passed
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from tailserve.engine.messages import EngineInput

logger = logging.getLogger(__name__)

# How often an idle engine tells the API process it is alive (with fresh gauges). The
# client's watchdog allows many of these to go missing before it calls the engine dead.
HEARTBEAT_S = 0.25


class EngineFatalError(RuntimeError):
    """The engine loop cannot go on; an ``EngineDead`` message has already been emitted."""


class DrivenLoop(Protocol):
    """What the driver needs of ``engine.loop.EngineLoop`` (a protocol, so tests can fake it)."""

    def handle(self, inputs: list[EngineInput]) -> bool: ...

    def has_work(self) -> bool: ...

    def step(self) -> None:
        """One engine step; raises ``EngineFatalError`` when the model failed."""

    def heartbeat_if_due(self, interval_s: float) -> None: ...


def drive(
    loop: DrivenLoop,
    wait_for_inputs: Callable[[float], list[EngineInput]],
    parent_gone: Callable[[], bool] = lambda: False,
) -> int:
    """Run ``loop`` until told to stop; returns the host's exit status.

    ``wait_for_inputs(timeout_s)`` returns every input that has arrived, waiting up to
    ``timeout_s`` for the first one (0: do not wait). Returns 0 after a ``Shutdown`` or once
    ``parent_gone()``, and 1 when a step raised ``EngineFatalError`` (``EngineDead`` has been
    emitted by then).
    """
    while True:
        batch = wait_for_inputs(0.0 if loop.has_work() else HEARTBEAT_S)
        if batch and not loop.handle(batch):
            logger.info("engine shutting down")
            return 0
        # Checked every iteration, busy or not, so an orphan does not linger.
        if parent_gone():
            return 0
        if loop.has_work():
            try:
                loop.step()
            except EngineFatalError:
                return 1
        else:
            loop.heartbeat_if_due(HEARTBEAT_S)
