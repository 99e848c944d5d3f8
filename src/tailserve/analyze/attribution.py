"""From per-sample parts to per-cause shares of the tail, with evidence and advice.

Two references, because a tail can be a few bad samples or the whole run:

- the *clean* latency: the median of (value − every cause's part), what a sample costs with
  no cause at work (the service time);
- the median sample.

When the median is itself far above the clean latency (every request queues: overload,
exhausted KV), the tail's excess is measured from the clean latency and every cause's part
counts whole. Otherwise the excess is over the median, and each cause's contribution is its
part minus that part's median over all samples (what the typical sample also pays, the
network's millisecond or the prefill steps every decode shares, is not the tail's fault).
Either way contributions are floored at zero; when they claim more than the excess (they
overlap: a stall during a prefill step) they are scaled down to it; what they do not claim is
``unexplained_share`` (for E2EL mostly longer outputs and bigger batches: load, not a fault).

A metric whose tail is within ``NONE_FACTOR`` of its median, and whose median is within it of
the clean latency, has one cause: ``none``.

No false alarms: a cause is named only when what it adds to the tail (its seconds per tail
sample) is above two floors, and otherwise the metric reads ``none`` with the reason:

- the run's own **noise floor** at the tail percentile: the samples with every cause's part
  taken out are what the run would show with no cause at work; their percentile's distance
  above their median is the jitter no cause explains (the host's scheduling, the network);
- an **absolute floor** a person notices (``ABS_FLOOR_S``): 10 ms of TTFT, ITL or E2EL, 1 ms of
  TPOT (a mean over the request's tokens). A healthy server one request at a time on a busy
  host has ITL jitter of a few ms at its P99; that is not a fault to chase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.samples import Samples

# Twice the median: a request that arrives mid-step waits up to one step, so even an idle
# server's TTFT spreads by a step; below that there is no tail to explain.
NONE_FACTOR = 2.0
NONE_MIN_S = 0.5e-3  # below this excess a tail is noise, whatever the ratio
MIN_SHARE = 0.005
ABS_FLOOR_S = {"ttft": 0.010, "itl": 0.010, "e2el": 0.010, "tpot": 0.001}


@dataclass
class CauseShare:
    cause: str
    share: float
    seconds: np.ndarray  # per tail sample
    evidence: dict[str, Any] = field(default_factory=dict)  # raw figures (--json)
    advice: str = ""
    text: str = ""  # the evidence as sentences with units (evidence.py)
    basis: str = ""  # the signal the cause rests on, for this engine

    def as_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "share": round(self.share, 4), "evidence": self.evidence,
                "advice": self.advice, "summary": self.text, "basis": self.basis}


@dataclass
class MetricTail:
    metric: str
    n: int
    p50_s: float
    p99_s: float
    percentile: float
    threshold_s: float
    tail: np.ndarray  # indices into the Samples
    causes: list[CauseShare]
    unexplained_share: float
    cannot_judge: list[str]
    reference_s: float = 0.0  # what the excess is measured from
    whole_run: bool = False  # True: the median itself is inflated; reference = clean latency
    noise_s: float = 0.0  # the run's own noise floor at the percentile (module docstring)
    floor_s: float = 0.0  # the absolute floor for this metric
    none_reason: str = ""  # why the metric reads ``none`` (empty when a cause is named)
    dropped: list[str] = field(default_factory=list)  # causes below the floors

    def as_json(self) -> dict[str, Any]:
        return {"p50_ms": round(self.p50_s * 1e3, 3), "p99_ms": round(self.p99_s * 1e3, 3),
                "percentile": self.percentile,
                "threshold_ms": round(self.threshold_s * 1e3, 3), "num_samples": self.n,
                "num_tail": len(self.tail),
                "reference": "clean" if self.whole_run else "median",
                "reference_ms": round(self.reference_s * 1e3, 3),
                "noise_floor_ms": round(self.noise_s * 1e3, 3),
                "absolute_floor_ms": round(self.floor_s * 1e3, 3),
                "below_floors": self.dropped,
                "causes": [c.as_json() for c in self.causes],
                "unexplained_share": round(self.unexplained_share, 4),
                "cannot_judge": self.cannot_judge}


def attribute(s: Samples, percentile: float, cannot_judge: list[str]) -> MetricTail | None:
    ok = ~np.isnan(s.values)
    if ok.sum() == 0:
        return None
    vals = s.values
    p50 = float(np.median(vals[ok]))
    p99 = float(np.percentile(vals[ok], 99))
    thr = float(np.percentile(vals[ok], percentile))
    tail = np.flatnonzero(ok & (vals >= thr))
    mt = MetricTail(s.metric, int(ok.sum()), p50, p99, percentile, thr, tail, [], 0.0,
                    cannot_judge)
    base, whole_run = reference(s)
    mt.reference_s, mt.whole_run = base, whole_run
    mt.noise_s, mt.floor_s = noise_floor(s, percentile), ABS_FLOOR_S.get(s.metric, 0.0)
    excess = np.maximum(vals[tail] - base, 0.0)
    gate = max(mt.noise_s, mt.floor_s)
    ref = "the clean latency" if whole_run else "the median"
    over = f"the P{percentile:g} is {(thr - base) * 1e3:.1f} ms above {ref} ({base * 1e3:.1f} ms)"
    if not whole_run and (thr <= NONE_FACTOR * p50 or thr - p50 < NONE_MIN_S):
        return _none(mt, f"{over}, within the {NONE_FACTOR:g}x of the median a healthy server "
                     "shows: no tail to fix.")
    if excess.sum() <= 0 or thr - base <= gate:
        return _none(mt, f"{over}, within {_floors(mt)}, so no cause is named.")
    causes, mt.unexplained_share = split(s, tail, base, whole_run)
    mt.causes = [c for c in causes if float(c.seconds.mean()) > gate]
    mt.dropped = [c.cause for c in causes if float(c.seconds.mean()) <= gate]
    if not mt.causes:
        worst = max(causes, key=lambda c: c.share, default=None)
        what = "" if worst is None else (
            f"; the largest, {worst.cause}, adds {float(worst.seconds.mean()) * 1e3:.1f} ms "
            "per tail sample")
        return _none(mt, f"{over}, but no cause adds more than {_floors(mt)}{what}, so no "
                     "cause is named.")
    mt.unexplained_share = max(0.0, 1.0 - sum(c.share for c in mt.causes))
    return mt


def _floors(mt: MetricTail) -> str:
    """The two floors as a phrase, the larger first."""
    noise = (f"the run's own noise at P{mt.percentile:g} ({mt.noise_s * 1e3:.1f} ms: the spread "
             "left with every cause's part taken out)")
    floor = f"the {mt.floor_s * 1e3:g} ms a user notices"
    return f"{noise} and {floor}" if mt.noise_s >= mt.floor_s else f"{floor} and {noise}"


def _none(mt: MetricTail, reason: str) -> MetricTail:
    mt.causes = [CauseShare("none", 1.0, np.zeros(len(mt.tail)))]
    mt.none_reason = reason
    return mt


def noise_floor(s: Samples, percentile: float) -> float:
    """The run's own jitter at the percentile: how far the percentile of the samples with
    every cause's part taken out lies above their median (what the tail would be if no
    cause were at work)."""
    ok = ~np.isnan(s.values)
    if ok.sum() < 2:
        return 0.0
    parts = sum((np.nan_to_num(p) for p in s.parts.values()), np.zeros(len(s.values)))
    clean = (s.values - parts)[ok]
    return max(0.0, float(np.percentile(clean, percentile) - np.median(clean)))


def reference(s: Samples) -> tuple[float, bool]:
    """(what a sample's excess is measured from, whether that is the clean latency because
    the median itself is inflated) -- the module docstring's two references."""
    ok = ~np.isnan(s.values)
    vals = s.values
    p50 = float(np.median(vals[ok]))
    # The request's own prefill is service time it must pay, not a fault that inflates the
    # median: a run of long prompts (or a slow host) has a long clean TTFT too.
    parts = {c: np.nan_to_num(p) for c, p in s.parts.items() if c != "own_prefill"}
    clean = vals - sum(parts.values(), np.zeros(len(vals)))
    ref = float(np.clip(np.median(clean[ok]), 0.0, p50))
    whole_run = p50 > NONE_FACTOR * ref + NONE_MIN_S
    return (ref if whole_run else p50), whole_run


def split(s: Samples, idx: np.ndarray, base: float, whole_run: bool
          ) -> tuple[list[CauseShare], float]:
    """The causes' shares of the excess of the samples ``idx`` over ``base`` (largest first;
    each CauseShare's ``seconds`` is per sample of ``idx``) and the unexplained share."""
    ok = ~np.isnan(s.values)
    excess = np.maximum(s.values[idx] - base, 0.0)
    contrib: dict[str, np.ndarray] = {}
    for cause, p in s.parts.items():
        part = np.nan_to_num(p)
        floor = 0.0 if whole_run else float(np.median(part[ok]))
        contrib[cause] = np.maximum(part[idx] - floor, 0.0)
    total = sum(contrib.values(), np.zeros(len(idx)))
    scale = np.where(total > excess, excess / np.maximum(total, 1e-15), 1.0)
    denom = float(excess.sum())
    if denom <= 0:
        return [], 0.0
    shares = []
    for cause, c in contrib.items():
        c = c * scale
        share = float(c.sum()) / denom
        if share >= MIN_SHARE:
            shares.append(CauseShare(cause, share, c))
    shares.sort(key=lambda c: -c.share)
    return shares, max(0.0, 1.0 - sum(c.share for c in shares))


def time_ranges(t: np.ndarray, start: float, gap_s: float = 2.0,
                limit: int = 3) -> list[list[float]]:
    """The sample times as a few [from, to] ranges (seconds after the start), largest first."""
    t = np.sort(t[~np.isnan(t)]) - start
    if len(t) == 0:
        return []
    ranges: list[list[float]] = [[float(t[0]), float(t[0])]]
    counts = [1]
    for x in t[1:]:
        if x - ranges[-1][1] <= gap_s:
            ranges[-1][1] = float(x)
            counts[-1] += 1
        else:
            ranges.append([float(x), float(x)])
            counts.append(1)
    order = np.argsort(counts)[::-1][:limit]
    return [[round(ranges[i][0], 2), round(ranges[i][1], 2)] for i in sorted(order)]
