"""What one engine step hands from stage to stage, in order:

    Scheduler.schedule()          -> SchedulerOutput (ScheduledRequest per request)
    ModelRunner.execute(...)      -> RunnerOutput
    Scheduler.update_from_output  -> list[EngineOutput]  (+ StepStats from the core)

Plain dataclasses in the bottom layer: the scheduler, the runner, the engine and the edge all
import them without importing one another (``tests/test_layering.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tailserve.data.kv_events import KVCacheEvent
from tailserve.request import FinishReason, RequestTimestamps
from tailserve.sampling_params import SamplingParams


class BlockedReason(str, enum.Enum):
    """Why the head of the waiting queue was not admitted in a step. The values are what the
    timeline and ``StepStats`` carry (``tailserve diagnose`` reads them back through this enum)."""

    KV_CACHE = "kv_cache"  # free blocks / watermark
    MAX_NUM_SEQS = "max_num_seqs"
    TOKEN_BUDGET = "token_budget"
    PREEMPTION = "preemption"  # the step preempted a running request: no admission follows
    STEP_TIME = "itl_target"  # the step's time budget (the decodes' slack) is spent
    PARTIAL_PREFILLS = "partial_prefills"  # max_num_partial_prefills / max_long_...
    # Its tenant holds its share of the KV pool while another tenant waits.
    TENANT_SHARE = "tenant_share"

    def __str__(self) -> str:
        return self.value


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``token_ids`` start at position ``num_computed_tokens``.

    ``sample`` is true when the chunk ends at the request's last known token, so the runner
    draws the next token for it; a prefill chunk that stops short of the end samples nothing.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    is_prefill: bool
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...]
    # With KV cache groups (kv_groups.py): groups 1 .. n-1's tables (``block_ids`` is group
    # 0's); a slot a window released holds the null block 0. Empty with one group.
    group_block_ids: tuple[list[int], ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int
    num_decode_seqs: int
    # Requests preempted while building this step (their blocks are already freed).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Why the head of the waiting queue was not admitted this step, if it was not.
    admission_blocked_by: BlockedReason | None = None
    # The step's shape as the step-time model sees it (stepcost.py) and its prediction.
    num_decode_context_tokens: int = 0
    prefill_attention_pairs: int = 0
    predicted_s: float | None = None
    # Prefix-cache events (stored / removed block hashes) since the previous step, oldest
    # first; empty unless ``enable_kv_cache_events``. The engine publishes them before the
    # forward, so a router may route the next request here while this step runs.
    kv_events: list[KVCacheEvent] = field(default_factory=list)
    # Structured output: request_id -> the packed allowed-token mask (numpy int32 words, bit t
    # of word t // 32 = token t) of each constrained request that samples this step. Set by
    # the engine core after scheduling (engine/structured_output.py); the sampler applies it.
    token_bitmasks: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunnerOutput:
    # request_id -> the token sampled for it this step (only requests with ``sample``).
    sampled_token_ids: dict[str, int]
    # request_id -> {token_id: logprob} for requests that asked for logprobs.
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # Requests whose grammar is complete after this step's token (set by the engine core
    # before the scheduler's update, which ends them with FINISHED_STOPPED).
    grammar_stopped: set[str] = field(default_factory=set)


@dataclass
class EngineOutput:
    """New tokens of one request. ``finish_reason`` set means it is done."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request (None for EOS or length).
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    timestamps: RequestTimestamps | None = None
    timing: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepStats:
    """One engine step (Prometheus, timeline, dashboard read it; the core never renders it)."""

    t: float  # wall-clock (time.time()) at the end of the step, to join with client clocks
    step_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_scheduled_seqs: int
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_finished: int
    admission_blocked_by: BlockedReason | None = None
    # Engine-process memory sampled at the end of the step (keys as ``EngineState.memory``).
    memory: dict[str, float] = field(default_factory=dict)
    # The step-time model: what it predicted for this step before it ran, the shape it saw,
    # the time budget of the last step with decodes (``itl_target_s``: their smallest slack
    # less the margin), and its coefficients after learning from this step.
    predicted_s: float | None = None
    num_decode_context_tokens: int = 0
    prefill_attention_pairs: int = 0
    itl_target_s: float | None = None
    # The slack of the tightest decode at the last step with decodes (its next token's
    # deadline - the step's start); /metrics' tailserve:min_decode_slack_seconds.
    min_decode_slack_s: float | None = None
    step_model: dict[str, float] = field(default_factory=dict)
    # After the step: the most a step without decodes may take (None: not sized by time) and
    # the arrivals that found the engine busy per second of its work, which set its floor
    # (/metrics' tailserve:prefill_step_cap_seconds and tailserve:busy_arrival_rate).
    prefill_step_cap_s: float | None = None
    # What set that cap: itl_slo, fixed_cost, token_budget or arrivals (few arrive while the
    # engine works: step_time.prefill_step_cap_by).
    prefill_step_cap_by: str | None = None
    busy_arrival_rate: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
