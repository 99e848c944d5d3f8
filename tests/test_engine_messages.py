"""The msgpack wire format between the API process and the engine: every message survives a
round trip, and what must never reach the engine loop is refused at decode."""

from __future__ import annotations

import msgspec
import pytest

from tailserve.data.records import EngineState
from tailserve.data.step import EngineOutput, StepStats
from tailserve.engine.messages import (
    AddRequest,
    EngineDead,
    FinishRequests,
    Heartbeat,
    ProfileDone,
    Rejected,
    Shutdown,
    StartProfile,
    StepResult,
    input_decoder,
    input_encoder,
    message_decoder,
    message_encoder,
)
from tailserve.request import FinishReason, RequestStatus, RequestTimestamps
from tailserve.sampling_params import SamplingParams


def test_every_input_survives_msgpack() -> None:
    sp = SamplingParams(max_tokens=3, stop=["x"], logprobs=2, seed=7, temperature=0.5)
    for msg in (
        AddRequest("a", [1, 2], sp, 12.5, priority=3),
        FinishRequests(["a", "b"], RequestStatus.FINISHED_STOPPED),
        FinishRequests(["c"], RequestStatus.FINISHED_ABORTED),
        StartProfile(2.5, "/tmp/trace.json"),
        Shutdown(),
    ):
        assert input_decoder.decode(input_encoder.encode(msg)) == msg


def test_every_engine_message_survives_msgpack() -> None:
    state = EngineState(1.0, 2, 3, 4, 5, 6, {"rss_bytes": 7.0}, "cpu", [1, 0, 2])
    out = EngineOutput("a", [5], [{5: -0.5, 9: -1.5}], FinishReason.STOP, stop_reason="x",
                       timestamps=RequestTimestamps(1.0, 1.1, 1.2, 1.3, [1.15], [1.16]),
                       timing={"e2e_s": 0.3})
    stats = StepStats(1.0, 0.01, 3, 2, 3, 2, 0, 10, 20, 0, 1, 1, 1, "kv_cache", {"rss_bytes": 1})
    for m in (StepResult([out], stats, state, 9.0), StepResult([out], None, state, 9.1),
              Heartbeat(state, 9.5), Rejected("a", "queue_full", "full"),
              Rejected("b", "invalid_request", "too long", "max_tokens"),
              EngineDead("boom", ["a"]), ProfileDone("/tmp/t.json", "no profiler")):
        assert message_decoder.decode(message_encoder.encode(m)) == m


def test_finish_status_travels_as_the_enum() -> None:
    raw = input_encoder.encode(FinishRequests(["a"], RequestStatus.FINISHED_STOPPED))
    decoded = input_decoder.decode(raw)
    assert isinstance(decoded, FinishRequests)
    assert decoded.status is RequestStatus.FINISHED_STOPPED


def test_invalid_sampling_params_are_refused_at_decode() -> None:
    bad = msgspec.msgpack.decode(input_encoder.encode(AddRequest("a", [1], SamplingParams(), 0.0)))
    bad["sampling_params"]["n"] = 0
    with pytest.raises(msgspec.ValidationError, match="n must be in"):
        input_decoder.decode(msgspec.msgpack.encode(bad))


@pytest.mark.parametrize("status", [RequestStatus.WAITING, RequestStatus.RUNNING,
                                    RequestStatus.PREEMPTED])
def test_finish_with_a_live_status_is_refused(status: RequestStatus) -> None:
    with pytest.raises(ValueError, match=f"needs a finished status, got {status.name}"):
        FinishRequests(["a"], status)
    raw = msgspec.msgpack.encode({"type": "finish", "request_ids": ["a"], "status": int(status)})
    with pytest.raises(msgspec.ValidationError, match=f"got {status.name}"):
        input_decoder.decode(raw)
