"""What one engine step (or a finish from outside) produced for one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailserve.request import FinishReason, RequestTimestamps


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
