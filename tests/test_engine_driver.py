"""The one engine-loop driver (``drive`` in engine/loop.py) against a scripted fake loop: what
it waits for, when it steps, when it heartbeats and what it returns."""

from __future__ import annotations

from collections import deque

from tailserve.engine.loop import HEARTBEAT_S, EngineFatalError, drive
from tailserve.engine.messages import EngineInput, FinishRequests, Shutdown
from tailserve.request import RequestStatus

FINISH = FinishRequests(["a"], RequestStatus.FINISHED_ABORTED)


class FakeLoop:
    """Has work for ``busy_steps`` steps; records every call the driver makes."""

    def __init__(self, busy_steps: int = 0, fail_at_step: int | None = None) -> None:
        self.busy_steps = busy_steps
        self.fail_at_step = fail_at_step
        self.calls: list[tuple[str, object]] = []
        self.num_steps = 0

    def handle(self, inputs: list[EngineInput]) -> bool:
        self.calls.append(("handle", [type(m).__name__ for m in inputs]))
        return not any(isinstance(m, Shutdown) for m in inputs)

    def has_work(self) -> bool:
        return self.num_steps < self.busy_steps

    def step(self) -> None:
        self.num_steps += 1
        self.calls.append(("step", self.num_steps))
        if self.num_steps == self.fail_at_step:
            raise EngineFatalError("model failed")

    def heartbeat_if_due(self, interval_s: float) -> None:
        self.calls.append(("heartbeat_if_due", interval_s))


class Inputs:
    """Hands out scripted batches, one per call; records the timeouts it was asked for."""

    def __init__(self, *batches: list[EngineInput]) -> None:
        self.batches = deque(batches)
        self.timeouts: list[float] = []

    def __call__(self, timeout_s: float) -> list[EngineInput]:
        self.timeouts.append(timeout_s)
        return self.batches.popleft() if self.batches else [Shutdown()]


def test_idle_loop_waits_a_heartbeat_interval_then_heartbeats() -> None:
    loop, inputs = FakeLoop(), Inputs([], [], [Shutdown()])
    assert drive(loop, inputs) == 0
    assert inputs.timeouts == [HEARTBEAT_S, HEARTBEAT_S, HEARTBEAT_S]
    assert loop.calls == [
        ("heartbeat_if_due", HEARTBEAT_S),
        ("heartbeat_if_due", HEARTBEAT_S),
        ("handle", ["Shutdown"]),
    ]


def test_busy_loop_polls_without_waiting_and_steps() -> None:
    loop, inputs = FakeLoop(busy_steps=2), Inputs([], [FINISH], [], [Shutdown()])
    assert drive(loop, inputs) == 0
    assert inputs.timeouts == [0.0, 0.0, HEARTBEAT_S, HEARTBEAT_S]
    assert loop.calls == [
        ("step", 1),
        ("handle", ["FinishRequests"]),
        ("step", 2),
        ("heartbeat_if_due", HEARTBEAT_S),
        ("handle", ["Shutdown"]),
    ]


def test_inputs_are_applied_before_the_step_that_follows_them() -> None:
    loop, inputs = FakeLoop(busy_steps=1), Inputs([FINISH, FINISH], [Shutdown()])
    assert drive(loop, inputs) == 0
    assert loop.calls == [
        ("handle", ["FinishRequests", "FinishRequests"]), ("step", 1), ("handle", ["Shutdown"]),
    ]


def test_shutdown_ends_the_loop_before_any_step() -> None:
    loop = FakeLoop(busy_steps=5)
    assert drive(loop, Inputs([FINISH, Shutdown()])) == 0
    assert loop.calls == [("handle", ["FinishRequests", "Shutdown"])]


def test_a_gone_parent_ends_the_loop_even_when_busy() -> None:
    loop, checks = FakeLoop(busy_steps=5), iter([False, False, True])
    assert drive(loop, Inputs([], [], []), lambda: next(checks)) == 0
    assert loop.calls == [("step", 1), ("step", 2)]


def test_a_model_failure_ends_the_loop_with_status_1() -> None:
    loop = FakeLoop(busy_steps=5, fail_at_step=2)
    assert drive(loop, Inputs([], [], [])) == 1
    assert loop.calls == [("step", 1), ("step", 2)]
