"""The engine's gauges at one instant, sent with every step and with idle heartbeats."""

from __future__ import annotations

from dataclasses import dataclass, field


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
