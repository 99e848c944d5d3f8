"""RequestOutput: what the offline API returns for one prompt (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailserve.request import RequestTimestamps


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # The stop string or stop token id that ended it; None for EOS or length.
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # Engine timestamps of the first completion (time.monotonic seconds).
    metrics: RequestTimestamps | None = None
    # ``tailserve_timing`` of each completion, in ``outputs`` order.
    timing: list[dict[str, Any]] = field(default_factory=list)
