"""One window between two scrapes: SLO attainment and P99 from the histograms' bucket deltas,
whether the P99 jumped above the earlier windows' level, and the likely cause from what the
engine's counters and gauges (and tailserve's step timeline) showed in the same window.

**A jump** is judged on what the buckets can prove: the window's P99 is known to lie in
``(low, high]`` (hist.py); the earlier windows' level is the median of their P99s' upper
edges over the last ``BASELINE_WINDOWS`` windows that did not jump. The window jumped when
its P99's *lower* edge is above that level by more than the largest of: the level again
(``JUMP_FACTOR``, diagnose's window rule), the absolute floor a user notices
(``ABS_FLOOR_S``, diagnose's), and the earlier windows' own spread (their P90 less their
median: the host's noise at this load, as diagnose's noise floor is the run's own).

**The cause** is read from the window's signals (engines/: each family's names), in this
order, the first that holds:

- TTFT: ``preemption`` (the preemption counter rose), ``kv_cache_pressure`` (requests waited
  while the KV cache was near full, counters.kv_bound), ``queueing`` (queue time was at least
  ``QUEUE_SHARE`` of the window's mean TTFT, from the queue-time and TTFT histograms' sums; an
  engine without a queue histogram: requests were waiting), ``own_prefill`` (prompt tokens per
  request rose ``CHANGE_FACTOR`` x), ``prefill_interference`` (prompt tokens per second rose);
- ITL: ``preemption``, ``prefill_interference`` (the steps' prefill-token share, or prompt
  tokens per second, rose), ``engine_stall`` (tailserve's timeline: the longest step beyond
  the earlier windows' longest by the jump rule, with no prefill to explain it).

When none holds, no cause is named and the window says what moved with the latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.attribution import ABS_FLOOR_S
from tailserve.analyze.watch.hist import Bound, Buckets, quantile, share_at_most
from tailserve.analyze.windows import CHANGE_FACTOR, JUMP_FACTOR
from tailserve.bench.gpu import DeviceMemory

BASELINE_WINDOWS = 12
NOISE_QUANTILE = 90
QUEUE_SHARE = 0.5
METRICS = ("ttft", "itl")
LABEL = {"ttft": "TTFT", "itl": "ITL"}


@dataclass
class MetricWindow:
    metric: str
    n: float = 0.0  # samples in the window (requests for TTFT, token gaps for ITL)
    p50: Bound | None = None
    p99: Bound | None = None
    slo_s: float | None = None
    attained: Bound | None = None  # share of the window's samples within the SLO
    level_s: float | None = None  # the earlier windows' P99 level (module docstring)
    threshold_s: float | None = None  # a P99 whose lower edge is above this jumped
    jumped: bool = False
    cause: str | None = None
    why: str = ""  # the cause's evidence as a sentence, or why none is named
    note: str = ""  # what cannot be judged for this metric, and why

    def as_json(self) -> dict[str, Any]:
        def b(x: Bound | None, scale: float) -> dict[str, float | None] | None:
            return None if x is None else x.as_json(scale)

        return {"n": self.n, "p50_ms": b(self.p50, 1e3), "p99_ms": b(self.p99, 1e3),
                "slo_ms": None if self.slo_s is None else self.slo_s * 1e3,
                "attained": b(self.attained, 1.0),
                "level_ms": None if self.level_s is None else round(self.level_s * 1e3, 3),
                "threshold_ms": None if self.threshold_s is None else
                round(self.threshold_s * 1e3, 3),
                "jumped": self.jumped, "cause": self.cause, "why": self.why, "note": self.note}


@dataclass
class Window:
    index: int
    t0: float
    t1: float
    engine: str
    metrics: dict[str, MetricWindow]
    signals: dict[str, float]
    since_start: dict[str, Bound | None] = field(default_factory=dict)  # SLO share, whole watch
    gpus: list[DeviceMemory] | None = None
    memory_gap_bytes: float | None = None  # allocator reserved - allocated, where exported
    notes: list[str] = field(default_factory=list)

    @property
    def jumped(self) -> list[str]:
        return [m for m, mw in self.metrics.items() if mw.jumped]

    @property
    def cause(self) -> str | None:
        return next((mw.cause for mw in self.metrics.values() if mw.jumped and mw.cause), None)

    @property
    def gpu_alert(self) -> bool:
        return any(g.alert for g in self.gpus or ())

    def as_json(self) -> dict[str, Any]:
        return {"window": self.index, "t0": round(self.t0, 3), "t1": round(self.t1, 3),
                "engine": self.engine, "jumped": self.jumped, "cause": self.cause,
                "metrics": {m: mw.as_json() for m, mw in self.metrics.items()},
                "slo_attained_since_start": {m: None if b is None else b.as_json()
                                             for m, b in self.since_start.items()},
                "signals": {k: round(v, 6) for k, v in self.signals.items()},
                "gpus": None if self.gpus is None else [g.as_json() for g in self.gpus],
                "gpu_alert": self.gpu_alert, "memory_gap_bytes": self.memory_gap_bytes,
                "notes": self.notes}


def judge_metric(mw: MetricWindow, buckets: Buckets, earlier: list[MetricWindow]) -> None:
    """Fill the window's percentiles and SLO share from its bucket deltas and judge a jump
    against the earlier windows (oldest first)."""
    mw.n = buckets.count
    mw.p50, mw.p99 = quantile(buckets, 0.5), quantile(buckets, 0.99)
    if mw.slo_s is not None:
        mw.attained = share_at_most(buckets, mw.slo_s)
    levels = [e.p99.high for e in earlier[-BASELINE_WINDOWS:]
              if e.p99 is not None and not e.jumped and not math.isinf(e.p99.high)]
    if mw.p99 is None or not levels:
        return
    level = float(np.median(levels))
    noise = max(0.0, float(np.percentile(levels, NOISE_QUANTILE)) - level)
    mw.level_s = level
    mw.threshold_s = level + max((JUMP_FACTOR - 1.0) * level, ABS_FLOOR_S[mw.metric], noise)
    mw.jumped = mw.p99.low > mw.threshold_s


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _rose(now: float | None, usual: float | None) -> bool:
    if now is None or now <= 0:
        return False
    return usual is None or usual <= 0 or now > CHANGE_FACTOR * usual


def _stalled(step: float | None, usual: float | None) -> bool:
    """The longest step beyond the earlier windows' longest by the jump rule."""
    if step is None or not usual:
        return False
    return step > usual + max((JUMP_FACTOR - 1.0) * usual, ABS_FLOOR_S["itl"])


def name_cause(mw: MetricWindow, sig: dict[str, float], usual: dict[str, float]) -> None:
    """The jumped metric's likely cause from the window's signals against their usual values
    (the mean over earlier windows that did not jump)."""
    u = usual.get
    g = sig.get
    pre, waiting, kv = g("preemptions", 0.0), g("waiting", 0.0), g("kv_usage")
    # The evidence of prefill interference read off the prompt tokens entering (both views).
    inflow = (f"{g('prompt_tokens_per_s', 0.0):.0f} prompt tokens/s entered (usually "
              f"{u('prompt_tokens_per_s', 0.0):.0f})")
    if pre > 0:
        kv_s = f" with the KV cache {_pct(kv)} used" if kv is not None else ""
        mw.cause, mw.why = "preemption", f"{pre:.0f} preemptions in the window{kv_s}"
        return
    if mw.metric == "ttft":
        share = g("queue_share")
        if g("kv_bound", 0.0) > 0:
            mw.cause = "kv_cache_pressure"
            mw.why = (f"up to {waiting:.0f} requests waited while the KV cache was "
                      f"{_pct(kv or 0.0)} used")
        elif share is not None and share >= QUEUE_SHARE:
            mw.cause = "queueing"
            mw.why = (f"queue time was {_pct(min(share, 1.0))} of the window's mean TTFT "
                      f"(mean queue {g('queue_mean_s', 0.0) * 1e3:.0f} ms)"
                      + (f"; up to {waiting:.0f} requests waiting" if waiting > 0 else ""))
        elif share is None and waiting > 0:
            mw.cause, mw.why = "queueing", f"up to {waiting:.0f} requests waiting"
        elif _rose(g("prompt_tokens_per_request"), u("prompt_tokens_per_request")):
            mw.cause = "own_prefill"
            mw.why = (f"prompts averaged {g('prompt_tokens_per_request', 0.0):.0f} tokens "
                      f"(usually {u('prompt_tokens_per_request', 0.0):.0f})")
        elif _rose(g("prompt_tokens_per_s"), u("prompt_tokens_per_s")):
            mw.cause, mw.why = "prefill_interference", inflow
    else:
        if _rose(g("prefill_token_share"), u("prefill_token_share")):
            mw.cause = "prefill_interference"
            mw.why = (f"prefill was {_pct(g('prefill_token_share', 0.0))} of the steps' "
                      f"tokens (usually {_pct(u('prefill_token_share', 0.0))})")
        elif "prefill_token_share" not in sig and _rose(g("prompt_tokens_per_s"),
                                                        u("prompt_tokens_per_s")):
            mw.cause, mw.why = "prefill_interference", inflow
        elif _stalled(g("step_max_s"), u("step_max_s")):
            mw.cause = "engine_stall"
            mw.why = (f"the longest step took {g('step_max_s', 0.0) * 1e3:.0f} ms (usually "
                      f"{u('step_max_s', 0.0) * 1e3:.0f} ms) with no prefill to explain it")
    if mw.cause is None:
        moved = [k.replace("_", " ") for k in ("running", "waiting", "kv_usage",
                                               "prompt_tokens_per_s", "queue_mean_s")
                 if _rose(g(k), u(k))]
        mw.why = ("no cause named: " + (f"{', '.join(moved)} rose with it" if moved else
                                        "nothing the engine exports moved with it"))
