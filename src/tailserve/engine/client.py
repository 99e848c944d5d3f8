"""EngineClient: the API process's handle on the engine.

Two implementations behind one interface:

- ``MPEngineClient``: the engine runs in its own process (``engine/process.py``) and talks over
  ZMQ IPC sockets with msgpack messages; HTTP work can never stall the step loop.
- ``InprocEngineClient`` (``engine/inproc_client.py``): the same ``EngineLoop``, run by the same
  driver (``engine/loop.py``'s ``drive``) on a thread of this process, messages passed as
  objects; for tests and embedding.

The client owns one ``asyncio.Queue`` per engine request id. The engine's messages are
dispatched on the event loop: outputs go to their queue, stats to the listeners (metrics,
timeline), a death notice fails every queue.
"""

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
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tailserve.config import EngineArgs
from tailserve.data.records import EngineState
from tailserve.data.step import EngineOutput, StepStats
from tailserve.engine.messages import (
    AddRequest,
    EngineDead,
    EngineInput,
    EngineMessage,
    FinishRequests,
    Heartbeat,
    ProfileDone,
    Ready,
    Rejected,
    Shutdown,
    StartProfile,
    StartupFailed,
    StepResult,
    input_encoder,
    message_decoder,
)
from tailserve.errors import (
    InvalidRequestError,
    QueueFullError,
    SLORefusedError,
    SLOUnattainableError,
)
from tailserve.request import RequestStatus

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed or stopped; requests it held are lost."""


class EngineStartupError(RuntimeError):
    """The engine could not start (its message says why, e.g. a bad model path)."""


# What a request's queue yields: (engine-stamped step end, output), or an exception to raise.
StreamItem = tuple[float, EngineOutput] | BaseException


class EngineClient:
    """Base: request bookkeeping, message dispatch, health. Subclasses move the bytes."""

    def __init__(self, watchdog_timeout_s: float) -> None:
        self.info: Ready | None = None
        self.state: EngineState | None = None
        self.dead_reason: str | None = None
        self.watchdog_timeout_s = watchdog_timeout_s
        self.last_seen = time.monotonic()
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        # A listener's return value is ignored (Timeline.add_step returns its row).
        self.step_listeners: list[Callable[[StepStats], object]] = []
        self.state_listeners: list[Callable[[EngineState], None]] = []
        self.death_listeners: list[Callable[[str], None]] = []
        self._profile: asyncio.Future[ProfileDone] | None = None

    # ------------------------------------------------------------------ interface
    async def start(self) -> Ready:
        raise NotImplementedError

    def _send(self, msg: EngineInput) -> None:
        """Hand ``msg`` to the engine. Contract: when it raises, nothing was handed over."""
        raise NotImplementedError

    async def shutdown(self, timeout_s: float = 10.0) -> int | None:
        """Stop the engine; returns its exit code where there is a process."""
        raise NotImplementedError

    def engine_alive(self) -> bool:
        raise NotImplementedError

    def _gone_message(self) -> str:
        """Why the engine is not running, once ``engine_alive()`` is False."""
        raise NotImplementedError

    @property
    def gone_reason(self) -> str | None:
        """Why no request can be served now, or None while the engine runs.

        The death notice once there is one; before it, a process or thread found gone (the
        watchdog notices only at its next tick, and a request sent meanwhile would be lost).
        """
        if self.dead_reason is not None:
            return self.dead_reason
        if not self.engine_alive():
            return self._gone_message()
        return None

    # ------------------------------------------------------------------ requests
    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def is_inflight(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def inflight_request_ids(self) -> list[str]:
        return list(self._streams)

    def add_request(
        self, msg: AddRequest, q: asyncio.Queue[StreamItem] | None = None
    ) -> asyncio.Queue[StreamItem]:
        """Send a request; its outputs arrive on ``q`` (several requests may share one).

        All or nothing: when it raises (``EngineDeadError``, a reused id, a failed send),
        the request is neither registered nor in the engine, so ``num_inflight`` (which
        admission counts) is what it was before the call.
        """
        gone = self.gone_reason
        if gone is not None:
            raise EngineDeadError(gone)
        if msg.request_id in self._streams:
            raise InvalidRequestError(f"request_id {msg.request_id!r} is already in use")
        if q is None:
            q = asyncio.Queue()
        # Registered before the send: the engine's first output may be dispatched as soon as
        # the message is out, and must find its queue.
        self._streams[msg.request_id] = q
        try:
            self._send(msg)
        except BaseException:
            # A failed send handed nothing over (``_send``'s contract): no output will ever
            # come to finish this entry, so it goes now or the slot is lost for good.
            del self._streams[msg.request_id]
            raise
        return q

    def finish(
        self, request_ids: list[str], status: RequestStatus, *, deliver_final: bool
    ) -> None:
        """End requests in the engine, which frees their blocks before its next step.

        ``status`` says why: ``FINISHED_ABORTED`` (client gone, drain) or ``FINISHED_STOPPED``
        (a stop string matched here). ``deliver_final``: keep the requests' queues, so their
        final outputs (finish_reason ``abort`` / ``stop``) still arrive on them; otherwise the
        queues are dropped now and nothing more arrives. Ids not in flight are skipped, so
        finishing twice is harmless.
        """
        if not status.is_finished:
            raise ValueError(f"finish needs a finished status, got {status.name}")
        live = [rid for rid in request_ids if rid in self._streams]
        if not deliver_final:
            for rid in live:
                del self._streams[rid]
        if live and self.dead_reason is None:
            self._send(FinishRequests(live, status))

    async def profile(self, seconds: float, path: str) -> str:
        """Trace the engine for ``seconds``; returns the trace path (RuntimeError on failure)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._profile is not None:
            raise RuntimeError("a profile is already being captured")
        self._profile = asyncio.get_running_loop().create_future()
        try:
            self._send(StartProfile(seconds, path))
            # The engine checks its deadline after every step and idle heartbeat.
            done = await asyncio.wait_for(self._profile, seconds + 60.0)
        finally:
            self._profile = None
        if done.error is not None:
            raise RuntimeError(done.error)
        return done.path

    def healthy(self) -> bool:
        if self.dead_reason is not None or not self.engine_alive():
            return False
        # Heartbeats arrive every HEARTBEAT_S when idle and a message per step when busy.
        return time.monotonic() - self.last_seen < self.watchdog_timeout_s

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, msg: EngineMessage) -> None:
        self.last_seen = time.monotonic()
        if isinstance(msg, StepResult):
            for out in msg.outputs:
                q = self._streams.get(out.request_id)
                if q is None:
                    continue  # aborted here already
                q.put_nowait((msg.t, out))
                if out.finished:
                    del self._streams[out.request_id]
            self._set_state(msg.state)
            if msg.stats is not None:
                for step_cb in self.step_listeners:
                    step_cb(msg.stats)
        elif isinstance(msg, Heartbeat):
            self._set_state(msg.state)
        elif isinstance(msg, Rejected):
            q = self._streams.pop(msg.request_id, None)
            if q is not None:
                q.put_nowait(_rejection(msg))
        elif isinstance(msg, EngineDead):
            self._die(msg.message)
        elif isinstance(msg, Ready):
            self.info = msg
        elif (isinstance(msg, ProfileDone) and self._profile is not None
              and not self._profile.done()):
            self._profile.set_result(msg)

    def _set_state(self, state: EngineState) -> None:
        self.state = state
        for cb in self.state_listeners:
            cb(state)

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine dead: %s", reason)
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(EngineDeadError(reason))
        for cb in self.death_listeners:
            cb(reason)


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


def _rejection(msg: Rejected) -> Exception:
    """The engine's refusal as the error the edge maps (429 with Retry-After, or 400)."""
    if msg.kind == "queue_full":
        return QueueFullError(msg.message, msg.retry_after_s)
    if msg.kind == "ttft_slo":
        return SLORefusedError(msg.message, msg.predicted_ttft_s or 0.0, msg.retry_after_s or 1.0)
    if msg.kind == "ttft_slo_unattainable":
        return SLOUnattainableError(msg.message, param=msg.param)
    return InvalidRequestError(msg.message, param=msg.param)
