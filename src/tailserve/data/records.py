"""The engine and its requests as the edge sees them: frozen snapshots of the scheduler and
block manager (the only way out of them), the gauges sent with every step and heartbeat, and
one record per finished request (metrics, timeline, traces, dashboard).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KVCacheSnapshot:
    """Block counts and prefix-cache totals of one ``KVCacheManager``."""

    num_blocks: int
    # Blocks no request holds, including those that still hold a reusable cached prefix.
    num_free_blocks: int
    # Blocks in use per band of consecutive block ids (``kv.block_pool.usage_band_sizes``).
    band_used: tuple[int, ...]
    # Since start, in tokens (as vLLM counts): prompt tokens looked up, and found cached.
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Queue lengths and preemption total of one ``Scheduler``, with its block manager's, the
    ITL target in force and its step-time model's coefficients (``StepTimeModel.describe``)."""

    num_running: int
    num_waiting: int
    num_preemptions_total: int
    kv: KVCacheSnapshot
    itl_target_s: float | None = None
    # The slack of the tightest decode of the last step with decodes (its next token's
    # deadline - the step's start).
    min_decode_slack_s: float | None = None
    step_model: dict[str, float] = field(default_factory=dict)
    # The most a step without decodes may take now (``step_time.prefill_step_cap``; None:
    # steps are not sized by time) and the rate of arrivals that found the engine busy, per
    # second of its work (``engine/arrival_watch.py``), that sets its floor.
    prefill_step_cap_s: float | None = None
    prefill_step_cap_by: str | None = None  # itl_slo | fixed_cost | token_budget | arrivals
    busy_arrival_rate: float | None = None


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


# Why the API ended an engine request before the engine finished it (``abort_reason``):
# the client went away; a stop string matched in the detokenized text (finish_reason "stop":
# the choice succeeded, the engine was told to stop); SIGTERM's drain ran out of time; the
# engine died under it (finish_reason "error"); our own code failed while streaming it.
ABORT_REASONS = ("client_disconnect", "stop_string", "drain", "engine_error", "server_error")


@dataclass
class RequestRecord:
    """One finished (or failed / rejected-after-admission) request, as every sink receives it
    (metrics, timeline, traces, dashboard; each keeps what it needs: ``obs/timeline.py``'s row).

    ``finish_reason`` is OpenAI's word (stop, length, abort, error). ``error_type`` is set when
    the request failed (e.g. ``engine_error``). ``timing`` is the ``tailserve_timing`` dict of
    docs/DESIGN.md (None when the engine never saw the request). ``itl_s`` are the gaps between
    the request's streamed token batches as the API process saw them (engine-stamped step ends).
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
    # One of ABORT_REASONS when the API ended the engine request early, else None.
    abort_reason: str | None = None
    priority: int = 0
    # The tenant that sent it (docs/tenants.md); None without tenants.
    tenant: str | None = None
