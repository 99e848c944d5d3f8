"""EngineLoop: what the engine does between steps, shared by the engine process and the
in-process client. Inputs in (add / finish / shutdown / profile), messages out (step results,
heartbeats, rejections, death notices). ``engine.driver.drive`` runs it; its host decides
where messages go and how inputs arrive.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from tailserve import envs
from tailserve.data.records import EngineState
from tailserve.engine.core import EngineCore
from tailserve.engine.driver import EngineFatalError
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
from tailserve.request import Request

logger = logging.getLogger(__name__)



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
        # Read once, when the loop is built (see envs.py).
        self._fail_at_step = envs.TAILSERVE_TEST_FAIL_FORWARD_AT_STEP.get()
        slow_s = envs.TAILSERVE_TEST_SLOW_STEP_MS.get() / 1e3
        if slow_s > 0:
            # Around the runner, so the sleep lands inside the step's measured step_s: the
            # step is slower for the same batch, as on a slower host.
            execute = self.core.runner.execute

            def slow_execute(sched: Any) -> Any:
                time.sleep(slow_s)
                return execute(sched)

            self.core.runner.execute = slow_execute  # type: ignore[method-assign]

    def ready_message(self) -> Ready:
        core = self.core
        return Ready(config=core.config, model=core.loaded.source, pid=os.getpid(),
                     weight_bytes=dict(core.runner.weight_bytes))

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
                    )
                    self.core.add_request(req)
                except SLORefusedError as exc:
                    self._send(Rejected(msg.request_id, "ttft_slo", str(exc),
                                        predicted_ttft_s=exc.predicted_ttft_s,
                                        retry_after_s=exc.retry_after_s))
                except SLOUnattainableError as exc:
                    self._send(Rejected(msg.request_id, "ttft_slo_unattainable", str(exc),
                                        exc.param))
                except QueueFullError as exc:
                    self._send(Rejected(msg.request_id, "queue_full", str(exc)))
                except ValueError as exc:
                    param = getattr(exc, "param", None)
                    self._send(Rejected(msg.request_id, "invalid_request", str(exc), param))
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
            if self._fail_at_step is not None and self.num_steps >= self._fail_at_step:
                raise RuntimeError(f"injected forward failure at step {self.num_steps}")
            outputs, stats = self.core.step()
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
