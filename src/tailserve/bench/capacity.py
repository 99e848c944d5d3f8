"""Capacity under an SLO: the highest request rate at which a share of requests (90%, 99%)
still meets every SLO (Sarathi-Serve's "capacity", DistServe's per-GPU goodput).

The search is a pure planner over measured points, so it is tested on a fake server (a
function rate -> attainment) and driven by a real one the same way (bench/run.py, the peers
harness):

    points = []
    while (rate := next_rate(points, start)) is not None:
        points.append(Point(rate, measure(rate)))
    capacity(points)

How it searches, for each target in increasing strictness (90% first, then 99%, whose
capacity lies at or below the 90% one and reuses its points):

1. a coarse geometric ladder: from ``start`` (bench: half the throughput step's req/s, a rate
   the server can at least carry) up by ``factor`` while every rate meets the target, or down
   by it while none does, until one rate meets it and a higher one misses it;
2. bisection of that bracket at its geometric mean until ``hi / lo <= 1 + tolerance``.

Attainment need not be monotonic on a noisy machine: the bracket is always the *lowest* rate
that missed and the highest rate below it that met, so one lucky run above a miss is ignored
and the capacity reported is a rate that was measured to meet the target. The whole search is
bounded by ``max_steps`` runs (and by ``min_rate`` below); a target left unresolved says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TARGETS = (0.9, 0.99)


@dataclass(frozen=True)
class Point:
    rate: float  # requests/s offered
    attainment: float | None  # share of requests sent meeting every SLO; None: the run failed


@dataclass(frozen=True)
class SearchOptions:
    targets: tuple[float, ...] = TARGETS
    max_steps: int = 8
    tolerance: float = 0.1  # stop bisecting when hi / lo <= 1 + tolerance
    factor: float = 2.0  # the ladder's ratio
    min_rate: float = 1e-3  # req/s: below this the ladder stops going down

    def __post_init__(self) -> None:
        if not self.targets or any(not 0 < t <= 1 for t in self.targets):
            raise ValueError(f"capacity targets must be shares in (0, 1], got {self.targets}")
        if self.max_steps < 1:
            raise ValueError(f"--sweep-max-steps must be >= 1, got {self.max_steps}")
        if not self.tolerance > 0:
            raise ValueError(f"--sweep-tolerance must be > 0, got {self.tolerance}")
        if not self.factor > 1:
            raise ValueError(f"the ladder factor must be > 1, got {self.factor}")


@dataclass(frozen=True)
class Capacity:
    """One target's answer: the highest rate measured to meet it, below the lowest that did
    not (None: no rate met it), that missing rate (None: none missed), and whether the
    bracket is as tight as the tolerance asks."""

    target: float
    rate: float | None
    missed_at: float | None
    resolved: bool

    def as_json(self) -> dict[str, Any]:
        return {"target": self.target, "capacity_req_s": self.rate,
                "lowest_missing_rate": self.missed_at, "resolved": self.resolved}


def _meets(p: Point, target: float) -> bool:
    return p.attainment is not None and p.attainment >= target


def bracket(points: list[Point], target: float, tolerance: float) -> Capacity:
    fails = [p.rate for p in points if not _meets(p, target)]
    hi = min(fails) if fails else None
    passes = [p.rate for p in points if _meets(p, target) and (hi is None or p.rate < hi)]
    lo = max(passes) if passes else None
    resolved = lo is not None and hi is not None and hi / lo <= 1 + tolerance
    return Capacity(target, lo, hi, resolved)


def next_rate(points: list[Point], start: float, opts: SearchOptions | None = None
              ) -> float | None:
    """The next rate to measure given the points so far, or None when the search is done
    (every target resolved, a bound reached, or ``max_steps`` runs made)."""
    opts = opts or SearchOptions()
    if not start > 0 or math.isinf(start):
        raise ValueError(f"the capacity search needs a finite start rate > 0, got {start}")
    if len(points) >= opts.max_steps:
        return None
    if not points:
        return start
    measured = {p.rate for p in points}
    for target in sorted(opts.targets):
        c = bracket(points, target, opts.tolerance)
        if c.resolved:
            continue
        if c.missed_at is None:  # every rate met it: climb above the highest
            rate = max(measured) * opts.factor
        elif c.rate is None:  # nothing below the lowest miss met it: descend
            rate = c.missed_at / opts.factor
            if rate < opts.min_rate:
                continue  # not even a trickle meets it: this target has no capacity
        else:
            rate = math.sqrt(c.rate * c.missed_at)
        if rate in measured:  # a bisection that can no longer move (float precision)
            continue
        return rate
    return None


def capacities(points: list[Point], opts: SearchOptions | None = None) -> list[Capacity]:
    opts = opts or SearchOptions()
    return [bracket(points, t, opts.tolerance) for t in opts.targets]


def search(measure: Any, start: float, opts: SearchOptions | None = None
           ) -> tuple[list[Point], list[Capacity]]:
    """Run the whole search with ``measure(rate) -> attainment | None`` (a synchronous
    callable; bench/run.py drives ``next_rate`` itself from its event loop)."""
    opts = opts or SearchOptions()
    points: list[Point] = []
    while (rate := next_rate(points, start, opts)) is not None:
        points.append(Point(rate, measure(rate)))
    return points, capacities(points, opts)


def step_points(steps: list[dict[str, Any]]) -> list[Point]:
    """The (rate, attainment) of a sweep's open-loop steps (bench result dicts; the
    all-at-once throughput step has no rate and is not a point)."""
    out = []
    for s in steps:
        rate = s.get("request_rate")
        good = (s.get("tailserve") or {}).get("goodput")
        if isinstance(rate, (int, float)) and not math.isinf(rate) and good is not None:
            out.append(Point(float(rate), good.get("goodput_share")))
    return out


def capacity_summary(steps: list[dict[str, Any]], opts: SearchOptions | None = None
                     ) -> dict[str, Any]:
    """What a sweep's summary says about capacity: every target's answer and the points."""
    opts = opts or SearchOptions()
    points = step_points(steps)
    return {"targets": [c.as_json() for c in capacities(points, opts)],
            "points": [{"rate": p.rate, "goodput_share": p.attainment} for p in points],
            "search": {"max_steps": opts.max_steps, "tolerance": opts.tolerance,
                       "factor": opts.factor}}
