"""One finished request as the edge records it (metrics, timeline, traces, dashboard).

Built by the API process from engine messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One finished (or failed / rejected-after-admission) request, as the timeline stores it.

    ``finish_reason`` is OpenAI's word (stop, length, abort, error). ``error_type`` is set when
    the request failed (e.g. ``engine_error``). ``timing`` is the ``tailserve_timing`` dict of
    DESIGN.md (None when the engine never saw the request). ``itl_s`` are the gaps between the
    request's streamed token batches as the API process saw them (engine-stamped step ends).
    """

    t: float  # wall clock at finish
    request_id: str
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    timing: dict[str, Any] | None = None
    error_type: str | None = None
    http_status: int = 200
    arrival_time: float | None = None  # wall clock
    first_token_time: float | None = None  # wall clock
    finished_time: float | None = None  # wall clock
    itl_s: list[float] = field(default_factory=list)
    model: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("itl_s")
        return d
