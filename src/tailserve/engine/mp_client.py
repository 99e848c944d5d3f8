"""MPEngineClient: the engine in a child process (``engine/process.py``, started with
``spawn``), over ZMQ IPC sockets in a private temporary directory; the ``EngineClient`` base
(``engine/client.py``) holds the queues, the dispatch and the death notice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from tailserve.config import EngineArgs
from tailserve.engine.client import EngineClient, EngineStartupError
from tailserve.engine.messages import (
    EngineInput,
    Ready,
    Shutdown,
    StartupFailed,
    input_encoder,
    message_decoder,
)

logger = logging.getLogger(__name__)


class MPEngineClient(EngineClient):
    """The engine in a child process, over ZMQ IPC sockets in a private temporary directory."""

    def __init__(
        self,
        engine_args: EngineArgs,
        watchdog_timeout_s: float,  # ServerSettings.watchdog_timeout
        startup_timeout_s: float = 900.0,
        log_level: str = "INFO",
    ) -> None:
        super().__init__(watchdog_timeout_s)
        self.engine_args = engine_args
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level
        self._dir = tempfile.mkdtemp(prefix="tailserve-")  # mode 0700: only this user
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._proc: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._plain_out: zmq.Socket[bytes] | None = None
        self._reader_loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> Ready:
        in_addr = f"ipc://{os.path.join(self._dir, 'in')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'out')}"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        from tailserve.engine.process import engine_main

        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=engine_main,
            args=(dataclasses.asdict(self.engine_args), in_addr, out_addr, self.log_level),
            name="tailserve-engine",
            daemon=True,
        )
        self._proc.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise EngineStartupError(
                    f"the engine did not become ready within {self.startup_timeout_s:.0f} s"
                )
            if await self._out.poll(timeout=min(250, int(left * 1000))):
                msg = message_decoder.decode(await self._out.recv())
                if isinstance(msg, StartupFailed):
                    self._proc.join(5)
                    raise EngineStartupError(msg.message)
                if isinstance(msg, Ready):
                    self.info = msg
                    break
            elif not self._proc.is_alive():
                raise EngineStartupError(
                    f"the engine process exited during start-up (exit code {self._proc.exitcode})"
                )
        self.last_seen = time.monotonic()
        loop = asyncio.get_running_loop()
        self._start_reader(loop)
        self._tasks = [loop.create_task(self._watchdog())]
        return msg

    def _send(self, msg: EngineInput) -> None:
        # Encoded first, so a message that cannot be encoded raises before a byte is queued;
        # PUSH on a connected IPC pipe: non-blocking unless the high-water mark is hit.
        data = input_encoder.encode(msg)
        self._in.send(data, copy=False)

    def _start_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages from a loop callback on the socket's descriptor, through
        a plain (not asyncio) view of it: an awaited ``recv`` of zmq.asyncio made a Future and
        (re)registered the descriptor for every message, 17% of the API process's CPU on a
        streamed single request (one message a step; py-spy). The descriptor is zmq's
        edge-style signal: every wake drains the socket until ``EVENTS`` says empty, and
        the first drain runs now, for what came between ``Ready`` and here."""
        self._plain_out = zmq.Socket.shadow(self._out.underlying)
        self._reader_loop = loop
        loop.add_reader(self._plain_out.FD, self._drain)
        self._drain()

    def _drain(self) -> None:
        sock = self._plain_out
        assert sock is not None  # set before the descriptor is watched
        while not sock.closed and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            raw = sock.recv(zmq.NOBLOCK)
            try:
                self._dispatch(message_decoder.decode(raw))
            except Exception:  # one bad message must not stop the stream of the others
                logger.exception("engine message not handled")

    def _stop_reader(self) -> None:
        if self._reader_loop is not None and self._plain_out is not None:
            self._reader_loop.remove_reader(self._plain_out.FD)
            self._reader_loop = None

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(0.25)
            if not self._proc.is_alive():
                # Let the reader deliver an EngineDead that was sent just before the exit.
                await asyncio.sleep(0.1)
                self._die(self._gone_message())
            elif time.monotonic() - self.last_seen > self.watchdog_timeout_s:
                self._die(
                    f"the engine loop made no progress for {self.watchdog_timeout_s:.0f} s"
                )

    def engine_alive(self) -> bool:
        return self._proc is not None and bool(self._proc.is_alive())

    def _gone_message(self) -> str:
        if self._proc is None:
            return "the engine process was not started"
        return f"the engine process exited (exit code {self._proc.exitcode})"

    @property
    def exitcode(self) -> int | None:
        return None if self._proc is None else self._proc.exitcode

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    async def shutdown(self, timeout_s: float = 10.0) -> int | None:
        for task in self._tasks:
            task.cancel()
        self._stop_reader()
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._send(Shutdown())
            deadline = time.monotonic() + timeout_s
            while self._proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._proc.is_alive():
                logger.warning("engine did not stop within %.0f s; killing it", timeout_s)
                self._kill()
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.exitcode
