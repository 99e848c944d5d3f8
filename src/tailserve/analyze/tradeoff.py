"""The trade-off of a settings grid: goodput share, capacity, the Pareto fronts and the setting
to recommend for given SLOs. Pure functions of plain rows (one dict per grid point, as
analyze/sweep.py makes them), so they are tested exactly.

Definitions:

- a request is *good* when it completed, its TTFT is at most the TTFT SLO and no gap between
  two of its tokens exceeds the ITL SLO (its worst gap, not its mean: a user sees the stall);
- a point's *goodput share* is good requests / requests sent (a failed request is not good);
  its *capacity* (``tune --capacity``) the highest request rate measured with >= 90%
  (``capacity_90``) and >= 99% (``capacity_99``) of requests good (bench/capacity.py);
- the *goodput front*: with capacities, every point no other point beats on both capacity_90
  and capacity_99 (a setting may trade the 99% capacity for the 90% one); without, every
  point no other beats on both goodput share and output throughput (a setting may trade SLO
  attainment for throughput). A point dominates another when it is >= on both and > on one;
  equal points are both on the front. Ordered by the first objective, best first;
- the *latency front* (the plot's): every point no other has both a lower-or-equal P99 TTFT
  and P99 ITL, one of them lower;
- the *recommended* point: with capacities, the highest capacity_90, then capacity_99, then
  goodput share, then output throughput; without, the highest goodput share, then output
  throughput, then the smallest ``slo_ratio`` -- max(P99 TTFT / TTFT SLO, P99 ITL / ITL SLO),
  the most headroom. It *meets the SLOs* when at least 90% of its requests were good (with
  capacities: when some rate was). Remaining ties: grid order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tailserve.errors import check_slo_ms

TTFT_KEY = "p99_ttft_ms"
ITL_KEY = "p99_itl_ms"


@dataclass(frozen=True)
class Slos:
    """What a user promises: TTFT and the longest token gap, in milliseconds."""

    ttft_ms: float = field(default=2000.0, metadata={
        "flag": "slo_ttft_ms", "help": "TTFT SLO: the most a request may wait for its first "
        "token, and the most the recommended setting's P99 TTFT may be"})
    itl_ms: float = field(default=250.0, metadata={
        "flag": "slo_itl_ms", "help": "ITL SLO: the longest gap a request may see between two "
        "tokens, and the most the recommended setting's P99 ITL may be"})

    def __post_init__(self) -> None:
        for name, v in (("--slo-ttft-ms", self.ttft_ms), ("--slo-itl-ms", self.itl_ms)):
            check_slo_ms(name, v)


@dataclass(frozen=True)
class Recommendation:
    index: int  # into the rows given
    meets_slos: bool
    reason: str


def request_is_good(ttft_s: float | None, itls_s: Sequence[float], ok: bool,
                    slos: Slos) -> bool:
    if not ok or ttft_s is None or ttft_s * 1000.0 > slos.ttft_ms:
        return False
    return max(itls_s, default=0.0) * 1000.0 <= slos.itl_ms


def goodput_share(ttfts_s: Sequence[float | None], itls_s: Sequence[Sequence[float]],
                  ok: Sequence[bool], slos: Slos) -> float | None:
    """Good requests / requests sent; None when none were sent."""
    if not (len(ttfts_s) == len(itls_s) == len(ok)):
        raise ValueError(f"per-request lists differ in length: {len(ttfts_s)} TTFTs, "
                         f"{len(itls_s)} ITL lists, {len(ok)} outcomes")
    if not ok:
        return None
    good = sum(request_is_good(t, g, o, slos) for t, g, o in zip(ttfts_s, itls_s, ok,
                                                                  strict=True))
    return good / len(ok)


def usable(row: dict[str, Any]) -> bool:
    """A row with latencies: its server started and completed at least one request."""
    return ("error" not in row and bool(row.get("completed"))
            and row.get(TTFT_KEY) is not None and row.get(ITL_KEY) is not None)


def pareto_front(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the undominated usable rows, by P99 TTFT then P99 ITL."""
    pts = [(i, float(r[TTFT_KEY]), float(r[ITL_KEY])) for i, r in enumerate(rows) if usable(r)]
    front = [
        (x, y, i) for i, x, y in pts
        if not any(x2 <= x and y2 <= y and (x2 < x or y2 < y) for _, x2, y2 in pts)
    ]
    return [i for _, _, i in sorted(front)]


def slo_ratio(row: dict[str, Any], slos: Slos) -> float:
    return max(float(row[TTFT_KEY]) / slos.ttft_ms, float(row[ITL_KEY]) / slos.itl_ms)


TARGET_SHARE = 0.9  # a setting "meets the SLOs" when this share of its requests did


def has_capacity(rows: Sequence[dict[str, Any]]) -> bool:
    return any("capacity_90" in r for r in rows if usable(r))


def _num(v: Any) -> float:
    """A figure for ranking: None (not measured, or no rate met the target) sorts lowest."""
    return -1.0 if v is None else float(v)


def objectives(row: dict[str, Any], capacity: bool) -> tuple[float, float]:
    if capacity:
        return _num(row.get("capacity_90")), _num(row.get("capacity_99"))
    return _num(row.get("goodput_share")), _num(row.get("output_throughput"))


def goodput_front(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the undominated usable rows (module docstring), best first."""
    cap = has_capacity(rows)
    pts = [(i, *objectives(r, cap)) for i, r in enumerate(rows) if usable(r)]
    front = [
        (-x, -y, i) for i, x, y in pts
        if not any(x2 >= x and y2 >= y and (x2 > x or y2 > y) for _, x2, y2 in pts)
    ]
    return [i for _, _, i in sorted(front)]


def recommend(rows: Sequence[dict[str, Any]], slos: Slos) -> Recommendation | None:
    """The setting to use for ``slos`` (module docstring); None when no row is usable."""
    candidates = [i for i, r in enumerate(rows) if usable(r)]
    if not candidates:
        return None
    what = f"TTFT <= {slos.ttft_ms:g} ms and every gap <= {slos.itl_ms:g} ms"
    if has_capacity(rows):
        best = min(candidates, key=lambda i: (
            *(-v for v in objectives(rows[i], True)), -_num(rows[i].get("goodput_share")),
            -_num(rows[i].get("output_throughput")), i))
        r = rows[best]
        c90, c99 = r.get("capacity_90"), r.get("capacity_99")
        if c90 is None:
            return Recommendation(best, False, (
                f"no setting kept {TARGET_SHARE:.0%} of requests within {what} at any rate "
                "tried; this one has the best goodput share"))
        c99_text = "none" if c99 is None else f"{c99:.3g} req/s"
        return Recommendation(best, True, (
            f"the highest capacity: {c90:.3g} req/s with >= 90% of requests within {what} "
            f"(>= 99%: {c99_text}), of {len(candidates)} settings"))
    best = min(candidates, key=lambda i: (
        -_num(rows[i].get("goodput_share")), -_num(rows[i].get("output_throughput")),
        slo_ratio(rows[i], slos), i))
    share = _num(rows[best].get("goodput_share"))
    if share >= TARGET_SHARE:
        return Recommendation(best, True, (
            f"the highest goodput share: {_pct(share)} of requests within {what}, of "
            f"{len(candidates)} settings"))
    return Recommendation(best, False, (
        f"no setting kept {TARGET_SHARE:.0%} of requests within {what}; this one comes "
        f"closest with {_pct(share)}"))


def _pct(v: float) -> str:
    return "-" if v < 0 else f"{100 * v:.0f}%"
