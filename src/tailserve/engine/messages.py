"""Messages between the API process and the engine process (msgspec/msgpack, never pickle).

Token ids only cross the wire: tokenization, chat templates and detokenization stay in the
API process. Each message is a tagged struct so one typed decoder reads a whole union.

    API -> engine:  AddRequest | FinishRequests | Shutdown | StartProfile
    engine -> API:  Ready | StartupFailed | StepResult | Heartbeat | Rejected | EngineDead
                    | ProfileDone
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tailserve.config import EngineConfig
from tailserve.data.records import EngineState
from tailserve.data.step import EngineOutput, StepStats
from tailserve.request import RequestStatus
from tailserve.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # time.monotonic() when the API process received the HTTP request (system-wide clock), so
    # queue_s covers parsing, tokenization and the hop to the engine too.
    arrival_time: float
    priority: int = 0
    # The request's own SLO, seconds (headers x-slo-*, body "slo"); None: the server's.
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    slo_tpot_s: float | None = None
    cache_salt: str | None = None  # Request.cache_salt
    tenant: str | None = None  # Request.tenant
    tenant_weight: float = 1.0  # Request.tenant_weight


class FinishRequests(msgspec.Struct, tag="finish"):
    """End requests from outside the step and free their blocks before the next one.

    ``status`` says why: ``FINISHED_ABORTED`` (client gone, drain) or ``FINISHED_STOPPED`` (a
    stop string matched above the engine). Each request still unfinished gets a final output.
    """

    request_ids: list[str]
    status: RequestStatus

    def __post_init__(self) -> None:
        # Checked on construction and on decode, so the loop never applies a live status.
        if not self.status.is_finished:
            raise ValueError(f"FinishRequests needs a finished status, got {self.status.name}")


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class StartProfile(msgspec.Struct, tag="profile"):
    """Trace the engine for ``seconds`` with torch.profiler; write a Chrome trace to ``path``."""

    seconds: float
    path: str


class ProfileDone(msgspec.Struct, tag="profile_done"):
    path: str
    error: str | None = None


class Ready(msgspec.Struct, tag="ready"):
    """The engine is up; ``config`` is what it resolved (limits, pool size, device, dtype)."""

    config: EngineConfig
    model: str  # the weights' path
    pid: int
    # Resident weight bytes per storage format (GGUF block formats, float32): /metrics.
    weight_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    # Each model transform applied at start-up, in order (model/build.py), with the modules
    # it swapped by original type and count: the start-up log's line, and /metrics.
    transforms: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class StepResult(msgspec.Struct, tag="step"):
    """What one engine step (or a batch of aborts, then ``stats`` is None) produced."""

    outputs: list[EngineOutput]
    stats: StepStats | None
    state: EngineState
    t: float  # time.monotonic() at the end of the step


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    state: EngineState
    t: float


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: str
    kind: Literal["invalid_request", "queue_full", "ttft_slo", "ttft_slo_unattainable"]
    message: str
    param: str | None = None
    # ttft_slo: the prediction that refused it; ttft_slo and queue_full: when the queue
    # ahead should be gone.
    predicted_ttft_s: float | None = None
    retry_after_s: float | None = None


class EngineDead(msgspec.Struct, tag="dead"):
    """The engine loop failed; every request it held is lost. The process exits after this."""

    message: str
    request_ids: list[str]


EngineInput = AddRequest | FinishRequests | Shutdown | StartProfile
EngineMessage = (
    Ready | StartupFailed | StepResult | Heartbeat | Rejected | EngineDead | ProfileDone
)

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
message_encoder = msgspec.msgpack.Encoder()
message_decoder = msgspec.msgpack.Decoder(EngineMessage)
