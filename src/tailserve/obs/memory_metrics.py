"""The memory families of ``/metrics``: the engine process's memory report (``obs/memory.py``'s
keys, carried on ``EngineState.memory`` / ``StepStats.memory``) as gauges, and its running
alert and steady-memory counts as counters.

Absent keys (a CPU engine, CUDA not yet initialized) leave their gauges as they were. The engine
sends running totals for its counts; the counters here take the increase, so a report seen twice
counts once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import Counter, Gauge


class MemoryMetrics:
    def __init__(self, gauge: Callable[..., Gauge], counter: Callable[[str, str], Counter]) -> None:
        self.device_memory_used_bytes = gauge(
            "device_memory_used_bytes", "Device memory in use (all processes).", ("device",)
        )
        self.device_memory_total_bytes = gauge(
            "device_memory_total_bytes", "Device memory capacity.", ("device",)
        )
        self.torch_memory_allocated_bytes = gauge(
            "torch_memory_allocated_bytes", "Bytes held by live tensors in the engine process."
        )
        self.torch_memory_reserved_bytes = gauge(
            "torch_memory_reserved_bytes", "Bytes reserved by the torch caching allocator."
        )
        self.torch_memory_inactive_split_bytes = gauge(
            "torch_memory_inactive_split_bytes",
            "Reserved bytes in split blocks not in use (allocator fragmentation).",
        )
        self.device_memory_process_bytes = gauge(
            "device_memory_process_bytes", "Device memory used by the engine process (NVML).",
            ("device",),
        )
        self.kv_cache_memory_bytes = gauge(
            "kv_cache_memory_bytes", "Bytes of the KV cache pool (allocated once at start-up)."
        )
        self.engine_resident_memory_bytes = gauge(
            "engine_resident_memory_bytes", "Resident memory of the engine process."
        )
        self.host_memory_used_bytes = gauge(
            "host_memory_used_bytes", "Host RAM in use, all processes (CPU engines)."
        )
        self.host_memory_total_bytes = gauge("host_memory_total_bytes", "Host RAM.")
        self.memory_alerts = counter(
            "memory_alerts_total", "Times memory in use rose above the --memory-alert fraction."
        )
        self._memory_alerts_seen = 0.0
        self.steady_memory_growth_bytes = gauge(
            "steady_memory_growth_bytes",
            "--assert-steady-memory: growth over the post-warm-up baseline.",
        )
        self.steady_memory_violations = counter(
            "steady_memory_violations_total",
            "--assert-steady-memory: warnings that memory grew beyond the tolerance.",
        )
        self._steady_violations_seen = 0.0

    def set(self, memory: Mapping[str, float], device: str) -> None:
        """One memory report onto the families; ``device`` labels the device_* gauges
        (``EngineState`` carries it, the report does not)."""
        if (v := memory.get("torch_allocated_bytes")) is not None:
            self.torch_memory_allocated_bytes.set(v)
        if (v := memory.get("torch_reserved_bytes")) is not None:
            self.torch_memory_reserved_bytes.set(v)
        if (v := memory.get("device_used_bytes")) is not None:
            self.device_memory_used_bytes.labels(device=device).set(v)
        if (v := memory.get("device_total_bytes")) is not None:
            self.device_memory_total_bytes.labels(device=device).set(v)
        if (v := memory.get("device_process_bytes")) is not None:
            self.device_memory_process_bytes.labels(device=device).set(v)
        gauges = (
            ("torch_inactive_split_bytes", self.torch_memory_inactive_split_bytes),
            ("kv_cache_bytes", self.kv_cache_memory_bytes),
            ("rss_bytes", self.engine_resident_memory_bytes),
            ("host_used_bytes", self.host_memory_used_bytes),
            ("host_total_bytes", self.host_memory_total_bytes),
        )
        for key, g in gauges:
            if (v := memory.get(key)) is not None:
                g.set(v)
        alerts = memory.get("memory_alerts_total")
        if alerts is not None and alerts > self._memory_alerts_seen:
            self.memory_alerts.inc(alerts - self._memory_alerts_seen)
            self._memory_alerts_seen = alerts
        if (v := memory.get("steady_growth_bytes")) is not None:
            self.steady_memory_growth_bytes.set(v)
        violations = memory.get("steady_violations_total")
        if violations is not None and violations > self._steady_violations_seen:
            self.steady_memory_violations.inc(violations - self._steady_violations_seen)
            self._steady_violations_seen = violations
