"""Prometheus histograms as per-window bucket deltas, and what they can say honestly.

A histogram's buckets are cumulative counts at upper bounds (``le``). Between two scrapes the
increase of every bucket is the window's own histogram. From it:

- a **percentile** is known to lie in one bucket: the sample of nearest rank ``ceil(q n)`` is
  in the first bucket whose count reaches that rank, so the value is in ``(lower, upper]``
  exactly. :class:`Bound` carries those two edges and, as ``estimate``, the linear
  interpolation inside the bucket that Prometheus' ``histogram_quantile`` also makes (an
  assumption: samples spread evenly in the bucket). In the ``+Inf`` bucket only the lower
  edge is known and there is no estimate.
- the **share under an SLO** is exact when the SLO is a bucket edge; otherwise it lies
  between the shares at the edges around it (``low`` / ``high``), with the same linear
  estimate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass


class BucketError(ValueError):
    """A histogram whose buckets cannot be read (no ``+Inf`` bucket, counts that go down)."""


@dataclass(frozen=True)
class Buckets:
    """Cumulative counts ``cum[i]`` of samples <= ``le[i]`` (ascending; ``+Inf`` last)."""

    le: tuple[float, ...]
    cum: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.cum[-1] if self.cum else 0.0

    @staticmethod
    def of(pairs: Iterable[tuple[float, float]]) -> Buckets:
        """From (le, cumulative count) pairs in any order; raises BucketError when they are
        not a histogram."""
        items = sorted(pairs)
        if not items or not math.isinf(items[-1][0]):
            raise BucketError("no +Inf bucket")
        le = tuple(a for a, _ in items)
        cum = tuple(b for _, b in items)
        if len(set(le)) != len(le):
            raise BucketError("a bucket edge appears twice")
        if any(b < a for a, b in itertools.pairwise(cum)):
            raise BucketError("cumulative bucket counts go down")
        return Buckets(le, cum)

    def __add__(self, other: Buckets) -> Buckets:
        """Two label sets of one histogram (the same edges) as one."""
        if other.le != self.le:
            raise BucketError("label sets with different bucket edges")
        return Buckets(self.le, tuple(a + b for a, b in zip(self.cum, other.cum, strict=True)))


def window_delta(now: Buckets, before: Buckets | None) -> Buckets:
    """The samples observed between two scrapes. With no earlier scrape, or after a restart
    (a count went down), the counts since the server started are the window's."""
    if before is None:
        return now
    if before.le != now.le:
        raise BucketError("the bucket edges changed between scrapes")
    d = tuple(a - b for a, b in zip(now.cum, before.cum, strict=True))
    if any(x < 0 for x in d):
        return now
    return Buckets(now.le, d)


@dataclass(frozen=True)
class Bound:
    """A value known to lie in ``(low, high]`` (``high`` may be inf); ``estimate`` is the
    linear interpolation inside that interval, None when ``high`` is inf."""

    low: float
    high: float
    estimate: float | None

    @property
    def exact(self) -> bool:
        return self.low == self.high

    def as_json(self, scale: float = 1.0, digits: int = 4) -> dict[str, float | None]:
        def r(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else round(x * scale, digits)

        return {"low": r(self.low), "high": r(self.high), "estimate": r(self.estimate)}


def quantile(b: Buckets, q: float) -> Bound | None:
    """The nearest-rank ``q`` (0-1) quantile's bucket, None when the window has no sample."""
    n = b.count
    if n <= 0:
        return None
    rank = max(1.0, math.ceil(q * n - 1e-9))
    prev_le, prev_cum = 0.0, 0.0
    for le, cum in zip(b.le, b.cum, strict=True):
        if cum >= rank:
            if math.isinf(le):
                return Bound(prev_le, le, None)
            frac = (rank - prev_cum) / (cum - prev_cum)
            return Bound(prev_le, le, prev_le + (le - prev_le) * frac)
        prev_le, prev_cum = le, cum
    raise AssertionError("the +Inf bucket holds every sample")


def share_at_most(b: Buckets, x: float) -> Bound | None:
    """The share of the window's samples <= ``x``: exact at a bucket edge, else between the
    shares at the edges around ``x``; None when the window has no sample."""
    n = b.count
    if n <= 0:
        return None
    prev_le, prev_cum = 0.0, 0.0
    for le, cum in zip(b.le, b.cum, strict=True):
        if x == le:
            return Bound(cum / n, cum / n, cum / n)
        if x < le:
            if math.isinf(le):  # beyond the last finite edge: at least what it holds
                return Bound(prev_cum / n, 1.0, None)
            est = prev_cum + (cum - prev_cum) * (x - prev_le) / (le - prev_le)
            return Bound(prev_cum / n, cum / n, est / n)
        prev_le, prev_cum = le, cum
    return Bound(1.0, 1.0, 1.0)
