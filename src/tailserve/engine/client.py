"""EngineClient: the API process's handle on the engine.

Two implementations behind one interface:

- ``MPEngineClient`` (``engine/mp_client.py``): the engine runs in its own process
  (``engine/process.py``) and talks over ZMQ IPC sockets with msgpack messages; HTTP work
  can never stall the step loop.
- ``InprocEngineClient`` (``engine/inproc_client.py``): the same ``EngineLoop``, run by the same
  driver (``engine/loop.py``'s ``drive``) on a thread of this process, messages passed as
  objects; for tests and embedding.

The client owns one ``asyncio.Queue`` per engine request id. The engine's messages are
dispatched on the event loop: outputs go to their queue, stats to the listeners (metrics,
timeline), a death notice fails every queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

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
    StartProfile,
    StepResult,
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


def _rejection(msg: Rejected) -> Exception:
    """The engine's refusal as the error the edge maps (429 with Retry-After, or 400)."""
    if msg.kind == "queue_full":
        return QueueFullError(msg.message, msg.retry_after_s)
    if msg.kind == "ttft_slo":
        return SLORefusedError(msg.message, msg.predicted_ttft_s or 0.0, msg.retry_after_s or 1.0)
    if msg.kind == "ttft_slo_unattainable":
        return SLOUnattainableError(msg.message, param=msg.param)
    return InvalidRequestError(msg.message, param=msg.param)
