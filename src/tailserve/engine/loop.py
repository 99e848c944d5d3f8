"""EngineLoop and its driver: what the engine does between steps, and the loop that runs it.

``EngineLoop`` is shared by the engine process and the in-process client. Inputs in (add /
finish / shutdown / profile), messages out (step results, heartbeats, rejections, death
notices); its host decides where messages go and how inputs arrive.

``drive`` is the one loop both hosts run it with: the engine process (inputs from a ZMQ
socket, stops when its parent dies) and ``InprocEngineClient`` (inputs from a thread-safe
queue). Only how inputs arrive and how the host notices it is orphaned differ; they come in as
two callables::

    while True:
        inputs = wait_for_inputs(0 if busy else HEARTBEAT_S)
        if Shutdown in inputs: return 0
        if parent_gone(): return 0
        if busy: step (model failure: return 1)   else: heartbeat if HEARTBEAT_S passed

It imports the core (and so torch): ``engine/inproc_client.py`` imports it only in
``InprocEngineClient.start``, and the API process's multi-process client never loads it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

from tailserve.data.records import EngineState
from tailserve.engine.core import EngineCore
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
    StepResult,
)
from tailserve.errors import QueueFullError, SLORefusedError, SLOUnattainableError
from tailserve.obs.memory import MemoryMonitor, SteadyMemoryCheck
from tailserve.obs.profiling import ProfileCapture
from tailserve.request import SLO, Request

logger = logging.getLogger(__name__)

# How often an idle engine tells the API process it is alive (with fresh gauges). The
# client's watchdog allows many of these to go missing before it calls the engine dead.
HEARTBEAT_S = 0.25


class EngineFatalError(RuntimeError):
    """The engine loop cannot go on; an ``EngineDead`` message has already been emitted."""


class EngineLoop:
    def __init__(self, core: EngineCore, emit: Callable[[EngineMessage], None]) -> None:
        self.core = core
        self.emit = emit
        config = core.config
        self.device: str = config.runner.device
        self.num_steps = 0
        self.last_emit = time.monotonic()
        obs = config.observability
        self.memory = MemoryMonitor(self.device, config.cache.kv_cache_bytes, obs.memory_alert)
        self.steady = (
            SteadyMemoryCheck(self.memory.is_cuda, obs.steady_memory_tolerance * (1 << 20),
                              obs.steady_memory_warmup)
            if obs.assert_steady_memory else None
        )
        self.num_finished = 0
        self.profile: ProfileCapture | None = None
        # Before Ready, so the server is healthy only once no request has to wait for it:
        # built at the first constrained request, it put seconds of queue in front of it.
        self.grammar_tokenizer_s: float | None = None
        try:
            self.grammar_tokenizer_s = core.structured.build_tokenizer()
        except Exception as exc:  # a vocabulary llguidance cannot read: serve all the rest
            logger.warning("structured output: llguidance's tokenizer could not be built "
                           "(%s: %s); constrained requests will be refused",
                           type(exc).__name__, str(exc)[:300])

    def ready_message(self) -> Ready:
        core = self.core
        return Ready(config=core.config, model=core.model_source, pid=os.getpid(),
                     weight_bytes=dict(core.weight_bytes), transforms=core.transforms)

    def state(self) -> EngineState:
        snap = self.core.snapshot()
        return EngineState(
            t=time.time(),
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            free_blocks=snap.kv.num_free_blocks,
            total_blocks=snap.kv.num_blocks,
            num_preemptions_total=snap.num_preemptions_total,
            memory=self.memory.sample(),
            device=self.device,
            kv_band_used=list(snap.kv.band_used),
        )

    def _send(self, msg: EngineMessage) -> None:
        self.last_emit = time.monotonic()
        self.emit(msg)

    def handle(self, inputs: list[EngineInput]) -> bool:
        """Apply a batch of inputs; False once a ``Shutdown`` was among them."""
        finished = []
        running = True
        for msg in inputs:
            if isinstance(msg, AddRequest):
                # A refused add is answered with Rejected and leaves nothing behind: the
                # scheduler registers a request only after every check has passed.
                try:
                    req = Request(
                        msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                        arrival_time=msg.arrival_time, priority=msg.priority,
                        cache_salt=msg.cache_salt, tenant=msg.tenant,
                        tenant_weight=msg.tenant_weight,
                        slo=SLO(msg.slo_ttft_s, msg.slo_itl_s, msg.slo_tpot_s),
                    )
                    self.core.add_request(req)
                except (ValueError, QueueFullError) as exc:
                    self._send(_rejection(msg.request_id, exc))
            elif isinstance(msg, FinishRequests):
                finished.extend(self.core.finish_requests(msg.request_ids, msg.status))
            elif isinstance(msg, StartProfile):
                self._start_profile(msg)
            elif isinstance(msg, Shutdown):
                running = False
        if finished:
            # Finishing changes the gauges (blocks freed) even when no step follows.
            self._send(StepResult(finished, None, self.state(), time.monotonic()))
        return running

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> None:
        """Run one step and emit its result. Raises ``EngineFatalError`` if the model failed."""
        self.num_steps += 1
        try:
            outputs, stats = self.core.step()
            while self.core.rejected:  # refused when its grammar's matcher was built
                rid, refused = self.core.rejected.pop(0)
                self._send(_rejection(rid, refused))
        except Exception as exc:
            logger.exception("engine step %d failed", self.num_steps)
            lost = self.core.unfinished_request_ids()
            # The message names the exception type only: no paths, addresses or traceback.
            self._send(EngineDead(f"the model forward failed ({type(exc).__name__})", lost))
            raise EngineFatalError(str(exc)) from exc
        if outputs or stats is not None:
            state = self.state()
            if stats is not None:
                self.num_finished += stats.num_finished
                if self.steady is not None:
                    self.steady.observe(state.memory, self.num_finished)
                stats.memory = state.memory
            self._send(StepResult(outputs, stats, state, time.monotonic()))
        self.finish_profile_if_due()

    def heartbeat_if_due(self, interval_s: float) -> None:
        if time.monotonic() - self.last_emit >= interval_s:
            self._send(Heartbeat(self.state(), time.monotonic()))
        self.finish_profile_if_due()

    # ------------------------------------------------------------------ profiling
    def _start_profile(self, msg: StartProfile) -> None:
        if self.profile is not None:
            self._send(ProfileDone(msg.path, "a profile is already being captured"))
            return
        try:
            self.profile = ProfileCapture(msg.path, msg.seconds, self.device)
        except Exception as exc:
            logger.exception("could not start the profiler")
            self._send(ProfileDone(msg.path, f"could not start the profiler "
                                             f"({type(exc).__name__})"))

    def finish_profile_if_due(self) -> None:
        """Checked after every step and heartbeat (at least every HEARTBEAT_S when idle)."""
        if self.profile is None or not self.profile.due():
            return
        capture, self.profile = self.profile, None
        try:
            self._send(ProfileDone(capture.finish()))
        except Exception as exc:
            logger.exception("could not write the profile")
            self._send(ProfileDone(capture.path, f"could not write the trace "
                                                 f"({type(exc).__name__}: {exc})"))


# ---------------------------------------------------------------------- the driver
def _rejection(request_id: str, exc: BaseException) -> Rejected:
    """The message refusing ``request_id`` for ``exc`` (a ``ValueError`` of the request's)."""
    if isinstance(exc, SLORefusedError):
        return Rejected(request_id, "ttft_slo", str(exc), predicted_ttft_s=exc.predicted_ttft_s,
                        retry_after_s=exc.retry_after_s)
    if isinstance(exc, SLOUnattainableError):
        return Rejected(request_id, "ttft_slo_unattainable", str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return Rejected(request_id, "queue_full", str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, ValueError):
        return Rejected(request_id, "invalid_request", str(exc), getattr(exc, "param", None))
    # A failure of ours while building the matcher: refused by type, the loop goes on.
    return Rejected(request_id, "invalid_request",
                    f"the grammar could not be built ({type(exc).__name__})", "structured_outputs")


class DrivenLoop(Protocol):
    """What ``drive`` needs of an ``EngineLoop`` (a protocol, so tests can fake it)."""

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
