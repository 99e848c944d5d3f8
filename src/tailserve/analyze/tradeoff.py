"""The latency trade-off of a settings grid: goodput share, the Pareto front of P99 TTFT
against P99 ITL, and the setting to recommend for given SLOs. Pure functions of plain rows
(one dict per grid point, as analyze/sweep.py makes them), so they are tested exactly.

Definitions:

- a request is *good* when it completed, its TTFT is at most the TTFT SLO and no gap between
  two of its tokens exceeds the ITL SLO (its worst gap, not its mean: a user sees the stall);
- a point's *goodput share* is good requests / requests sent (a failed request is not good);
- point A *dominates* B when A's P99 TTFT and P99 ITL are both <= B's and one is <; the
  *front* is every point no other point dominates (equal points are both on it);
- the *recommended* point: among the points whose P99 TTFT and P99 ITL meet the SLOs, the one
  with the highest goodput share, then the highest output throughput, then the smallest
  ``slo_ratio`` (the most headroom); with none meeting them, the point with the smallest
  ``slo_ratio`` -- max(P99 TTFT / TTFT SLO, P99 ITL / ITL SLO), by how much the SLOs would have
  to grow for it to meet them -- then the highest goodput share. Remaining ties: grid order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tailserve.errors import ConfigError

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
            if not 0 < v < float("inf"):
                raise ConfigError(f"{name} must be a positive number of milliseconds, got {v}")


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


def meets(row: dict[str, Any], slos: Slos) -> bool:
    return (usable(row) and float(row[TTFT_KEY]) <= slos.ttft_ms
            and float(row[ITL_KEY]) <= slos.itl_ms)


def recommend(rows: Sequence[dict[str, Any]], slos: Slos) -> Recommendation | None:
    """The setting to use for ``slos`` (module docstring); None when no row is usable."""
    candidates = [i for i, r in enumerate(rows) if usable(r)]
    if not candidates:
        return None

    def share(i: int) -> float:
        v = rows[i].get("goodput_share")
        return -1.0 if v is None else float(v)

    feasible = [i for i in candidates if meets(rows[i], slos)]
    if feasible:
        best = min(feasible, key=lambda i: (
            -share(i), -float(rows[i].get("output_throughput") or 0.0),
            slo_ratio(rows[i], slos), i))
        among = ("the only setting that does" if len(feasible) == 1
                 else f"the highest of the {len(feasible)} that do")
        return Recommendation(best, True, (
            f"meets P99 TTFT <= {slos.ttft_ms:g} ms and P99 ITL <= {slos.itl_ms:g} ms; goodput "
            f"share {_pct(share(best))}, {among}"))
    best = min(candidates, key=lambda i: (slo_ratio(rows[i], slos), -share(i), i))
    return Recommendation(best, False, (
        f"no setting meets P99 TTFT <= {slos.ttft_ms:g} ms and P99 ITL <= {slos.itl_ms:g} ms; "
        f"this one comes closest: it would need SLOs {slo_ratio(rows[best], slos):.2f}x as "
        "loose"))


def _pct(v: float) -> str:
    return "-" if v < 0 else f"{100 * v:.0f}%"
