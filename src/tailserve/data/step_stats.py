"""Plain per-step statistics the engine core emits; the edge renders them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    admission_blocked_by: str | None = None
    # Engine-process memory sampled at the end of the step (keys as ``EngineState.memory``).
    memory: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
