"""From per-sample parts to per-cause shares of the tail, with evidence and advice.

For the samples at or above the chosen percentile, each sample's *excess* is its value minus
the median sample. Each cause's contribution to it is the cause's part minus that part's median
over all samples (what the typical sample also pays is not the tail's fault), floored at zero.
When the causes claim more than the excess (they overlap: a stall during a prefill step), they
are scaled down to it; what they do not claim is reported as ``unexplained_share`` (for E2EL
that is mostly longer outputs and bigger batches, which are load, not a fault).

A metric whose tail is within ``NONE_FACTOR`` of its median has one cause, ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.samples import Samples

NONE_FACTOR = 1.5
NONE_MIN_S = 0.5e-3  # below this excess a tail is noise, whatever the ratio
MIN_SHARE = 0.005


@dataclass
class CauseShare:
    cause: str
    share: float
    seconds: np.ndarray  # per tail sample
    evidence: dict[str, Any] = field(default_factory=dict)
    advice: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "share": round(self.share, 4), "evidence": self.evidence,
                "advice": self.advice}


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

    def as_json(self) -> dict[str, Any]:
        return {"p50_ms": round(self.p50_s * 1e3, 3), "p99_ms": round(self.p99_s * 1e3, 3),
                "percentile": self.percentile,
                "threshold_ms": round(self.threshold_s * 1e3, 3), "num_samples": self.n,
                "num_tail": len(self.tail),
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
    excess = np.maximum(vals[tail] - p50, 0.0)
    if thr <= NONE_FACTOR * p50 or thr - p50 < NONE_MIN_S or excess.sum() <= 0:
        mt.causes = [CauseShare("none", 1.0, np.zeros(len(tail)))]
        return mt
    contrib: dict[str, np.ndarray] = {}
    for cause, part in s.parts.items():
        good = part[ok & ~np.isnan(part)]
        base = float(np.median(good)) if len(good) else 0.0
        contrib[cause] = np.nan_to_num(np.maximum(part[tail] - base, 0.0))
    total = sum(contrib.values(), np.zeros(len(tail)))
    scale = np.where(total > excess, excess / np.maximum(total, 1e-15), 1.0)
    denom = float(excess.sum())
    shares = []
    for cause, c in contrib.items():
        c = c * scale
        share = float(c.sum()) / denom
        if share >= MIN_SHARE:
            shares.append(CauseShare(cause, share, c))
    shares.sort(key=lambda c: -c.share)
    mt.causes = shares
    mt.unexplained_share = max(0.0, 1.0 - sum(c.share for c in shares))
    return mt


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
