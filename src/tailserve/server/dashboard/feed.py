"""The live dashboard's data: one sample a second, computed once and fanned out to every viewer.

``GET /dashboard`` serves the static page next to this file; ``GET /dashboard/events`` is a
Server-Sent Events stream of samples (JSON, one ``data:`` line each). The first event replays
the last ``HISTORY_S`` seconds so a new page fills at once.

Cost model ("serving it must not move the engine's step time"): the engine runs in its own
process and never sees a viewer. In the API process, step and request listeners append to
bounded deques (O(1) each); one background task — started with the first viewer, stopped
with the last — turns them into a sample every second and serializes it once; each viewer
costs one queue put per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from tailserve.data.records import EngineState, RequestRecord
from tailserve.data.step import StepStats
from tailserve.kv.block_pool import usage_band_sizes
from tailserve.obs.metrics import ServerMetrics

logger = logging.getLogger(__name__)

HISTORY_S = 60  # samples kept (one a second), here and in the page
WINDOW_S = 60.0  # TTFT / ITL percentiles cover this many seconds of finished requests
_MAX_POINTS = 20000  # bound on the request and step deques (memory, and sort cost per sample)

_MEMORY_KEYS = {
    "rss_bytes": "engine_rss", "kv_cache_bytes": "kv_cache",
    "torch_allocated_bytes": "torch_allocated", "torch_reserved_bytes": "torch_reserved",
    "torch_inactive_split_bytes": "torch_inactive_split",
    "device_used_bytes": "device_used", "device_total_bytes": "device_total",
    "device_process_bytes": "device_process",
    "host_used_bytes": "host_used", "host_total_bytes": "host_total",
}  # fmt: skip


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, -(-int(q * len(sorted_values)) // 100))  # ceil(q/100 * n), at least 1
    return sorted_values[min(rank, len(sorted_values)) - 1]


class DashboardFeed:
    def __init__(
        self,
        metrics: ServerMetrics,
        state: Callable[[], EngineState | None],
        interval_s: float = 1.0,
    ) -> None:
        self.metrics = metrics
        self._state = state
        self.interval_s = interval_s
        self.history: deque[tuple[float, str]] = deque(maxlen=HISTORY_S)  # (t, JSON)
        self._steps: deque[tuple[float, float]] = deque(maxlen=_MAX_POINTS)  # (t, step_s)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_POINTS)  # (t, ttft_s)
        self._itl: deque[tuple[float, float]] = deque(maxlen=_MAX_POINTS)  # (t, gap_s)
        self._preemptions_total = 0
        self._viewers: set[asyncio.Queue[str]] = set()
        self._task: asyncio.Task[None] | None = None
        self.num_samples = 0
        self.closed = False

    # ------------------------------------------------------------------ inputs (O(1) each)
    def on_step(self, stats: StepStats) -> None:
        self._steps.append((stats.t, stats.step_s))
        self._preemptions_total += stats.num_preemptions

    def on_request(self, rec: RequestRecord) -> None:
        ttft = rec.timing.get("ttft_s") if rec.timing else None
        if isinstance(ttft, (int, float)):
            self._ttft.append((rec.t, float(ttft)))
        self._itl.extend((rec.t, gap) for gap in rec.itl_s)

    # ------------------------------------------------------------------ the sample
    def sample(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        out: dict[str, Any] = {"t": now}
        state = self._state()
        if state is not None:
            out.update(
                running=state.num_running, waiting=state.num_waiting,
                free_blocks=state.free_blocks, total_blocks=state.total_blocks,
                kv_usage=state.kv_cache_usage, kv_bands=self._bands(state),
                memory={_MEMORY_KEYS[k]: v for k, v in state.memory.items() if k in _MEMORY_KEYS},
                memory_alerts=state.memory.get("memory_alerts_total", 0.0),
            )
        steps = sorted(s for t, s in self._steps if t > now - self.interval_s)
        out["steps"] = len(steps)
        out["step_p50"] = percentile(steps, 50)
        out["step_p99"] = percentile(steps, 99)
        out["step_max"] = steps[-1] if steps else None
        for name, points in (("ttft", self._ttft), ("itl", self._itl)):
            start = now - WINDOW_S
            while points and points[0][0] < start:  # arrivals are in time order, nearly
                points.popleft()
            values = sorted(v for t, v in points if t >= start)
            out[f"{name}_p50"] = percentile(values, 50)
            out[f"{name}_p99"] = percentile(values, 99)
            out[f"{name}_n"] = len(values)
        out["preemptions_total"] = self._preemptions_total
        out["errors"] = self._counts(self.metrics.request_errors, "type")
        out["rejected"] = self._counts(self.metrics.requests_rejected, "reason")
        out["aborts"] = self._counts(self.metrics.request_aborts, "reason")
        return out

    @staticmethod
    def _bands(state: EngineState) -> list[float]:
        """Fraction of each band of block ids in use (0..1)."""
        used = state.kv_band_used
        if not used or not state.total_blocks:
            return []
        sizes = usage_band_sizes(state.total_blocks, len(used))
        return [u / s if s else 0.0 for u, s in zip(used, sizes, strict=True)]

    @staticmethod
    def _counts(counter: Any, label: str) -> dict[str, float]:
        out = {}
        for family in counter.collect():
            for s in family.samples:
                if s.name.endswith("_total") and s.value:
                    out[s.labels[label]] = s.value
        return out

    # ------------------------------------------------------------------ fan-out
    async def _run(self) -> None:
        next_at = time.monotonic()
        while self._viewers:
            try:
                sample = self.sample()
                data = json.dumps(sample, separators=(",", ":"))
            except Exception:  # a bad sample must not end the stream for everyone
                logger.exception("dashboard sample failed")
            else:
                self.num_samples += 1
                self.history.append((sample["t"], data))
                for q in list(self._viewers):
                    _put_latest(q, data)
            # After a stall, carry on from now rather than catch up with a burst.
            next_at = max(next_at + self.interval_s, time.monotonic())
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        self._task = None

    def close(self) -> None:
        """End every stream (the server is stopping: open streams must not hold it up)."""
        self.closed = True
        for q in list(self._viewers):
            _put_latest(q, "")

    async def events(self) -> AsyncIterator[str]:
        """One viewer's SSE stream: the history as one ``history`` event, then a sample a second."""
        if self.closed:
            return
        q: asyncio.Queue[str] = asyncio.Queue(maxsize=HISTORY_S)
        self._viewers.add(q)
        # Taken with q added and no await between: no sample is both here and in q. Samples from
        # before a pause with no viewers are older than the page's window: left out.
        oldest = time.time() - HISTORY_S
        past = [data for t, data in self.history if t > oldest]
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        try:
            yield "retry: 2000\n\n"
            if past:
                yield "event: history\ndata: [" + ",".join(past) + "]\n\n"
            while data := await q.get():  # "" is close()'s end mark
                yield "data: " + data + "\n\n"
        finally:
            self._viewers.discard(q)

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)


def _put_latest(q: asyncio.Queue[str], item: str) -> None:
    """Put without blocking; a stalled viewer loses its oldest sample, never holds memory."""
    if q.full():
        with contextlib.suppress(asyncio.QueueEmpty):
            q.get_nowait()
    q.put_nowait(item)
