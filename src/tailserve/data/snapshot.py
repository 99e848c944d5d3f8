"""Counters of the block manager and the scheduler at one instant, as frozen values.

The engine core and loop read these instead of reaching into the scheduler's block manager
and pool: ``Scheduler.snapshot()`` / ``KVCacheManager.snapshot()`` are the only way out.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """Queue lengths and preemption total of one ``Scheduler``, with its block manager's."""

    num_running: int
    num_waiting: int
    num_preemptions_total: int
    kv: KVCacheSnapshot
