"""What ``Scheduler.schedule()`` decided for one step; the model runner executes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tailserve.sampling_params import SamplingParams


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


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int
    num_decode_seqs: int
    # Requests preempted while building this step (their blocks are already freed).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Why the head of the waiting queue was not admitted this step, if it was not:
    # "kv_cache" (free blocks / watermark), "max_num_seqs", "token_budget", "preemption" or None.
    admission_blocked_by: str | None = None
