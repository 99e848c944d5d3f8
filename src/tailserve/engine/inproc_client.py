"""InprocEngineClient: the engine's ``EngineLoop`` on a thread of this process, run by the same
driver as the engine process (``engine/loop.py``'s ``drive``), messages passed as objects, not
bytes; for tests and embedding. Everything else (request bookkeeping, dispatch, health) is the
``EngineClient`` base's, shared with the engine process's ``MPEngineClient``
(``engine/mp_client.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Any

from tailserve.config import EngineArgs
from tailserve.engine.client import EngineClient
from tailserve.engine.messages import EngineInput, EngineMessage, Ready, Shutdown


class InprocEngineClient(EngineClient):
    """The engine loop on a thread of this process (tests, embedding). Same messages, no bytes."""

    def __init__(self, engine_args: EngineArgs, loaded: Any = None) -> None:
        super().__init__(watchdog_timeout_s=float("inf"))
        self.engine_args = engine_args
        self._loaded = loaded
        self._inbox: queue.Queue[EngineInput] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> Ready:
        from tailserve.engine.core import EngineCore
        from tailserve.engine.loop import EngineLoop, drive

        self._aloop = asyncio.get_running_loop()
        core = await asyncio.to_thread(EngineCore.from_args, self.engine_args, self._loaded)
        engine_loop = EngineLoop(core, self._emit)
        self.info = engine_loop.ready_message()

        def run() -> None:
            try:
                drive(engine_loop, self._wait_for_inputs, self._loop_gone)
            finally:
                core.close()

        self._thread = threading.Thread(target=run, name="tailserve-engine", daemon=True)
        self._thread.start()
        return self.info

    def _emit(self, msg: EngineMessage) -> None:
        assert self._aloop is not None
        # The event loop may close between the driver's check and this call; then nobody is
        # left to read the message.
        with contextlib.suppress(RuntimeError):
            self._aloop.call_soon_threadsafe(self._dispatch, msg)

    def _loop_gone(self) -> bool:
        """The in-process host's "parent": once its event loop is closed, the engine stops."""
        return self._aloop is None or self._aloop.is_closed()

    def _wait_for_inputs(self, timeout_s: float) -> list[EngineInput]:
        batch: list[EngineInput] = []
        try:
            batch.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0
                         else self._inbox.get_nowait())
        except queue.Empty:
            return batch
        while True:
            try:
                batch.append(self._inbox.get_nowait())
            except queue.Empty:
                return batch

    def _send(self, msg: EngineInput) -> None:
        self._inbox.put(msg)

    def engine_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _gone_message(self) -> str:
        if self._thread is None:
            return "the engine thread was not started"
        return "the engine thread has stopped"

    async def shutdown(self, timeout_s: float = 10.0) -> int | None:
        self._send(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        return None
