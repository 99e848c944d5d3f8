"""What ``ModelRunner.execute()`` produced for one step; the scheduler applies it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunnerOutput:
    # request_id -> the token sampled for it this step (only requests with ``sample``).
    sampled_token_ids: dict[str, int]
    # request_id -> {token_id: logprob} for requests that asked for logprobs.
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
