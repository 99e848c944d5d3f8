"""Plain records the edge renders: one per finished request, one engine-state snapshot.

Torch-free and prometheus-free; built by the API process from engine messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineState:
    """Gauges of the engine at one instant (sent with every step and with idle heartbeats)."""

    t: float  # wall clock, time.time()
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    num_preemptions_total: int
    # Engine-process memory, bytes (keys: ``obs.memory``'s docstring): rss_bytes always;
    # torch_*, device_* where a device has them; host_* on CPU; memory_alerts_total a count.
    memory: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    # KV blocks in use per band of consecutive block ids (``kv.block_pool.usage_band_sizes``
    # gives the band sizes); the dashboard draws it as a heatmap.
    kv_band_used: list[int] = field(default_factory=list)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks in use (reusable prefix-cache blocks count as free)."""
        if self.total_blocks == 0:
            return 0.0
        return 1.0 - self.free_blocks / self.total_blocks


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
