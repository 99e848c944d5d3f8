"""``tailserve compare``'s SLO gates: goodput share and capacity, A against B.

**Goodput** (two step results): each request of each run is judged against the SLOs as the
bench judges it (bench/goodput.py: client-measured TTFT, every ITL gap, TPOT); the SLOs are
the ones given to compare (``--slo-ttft-ms`` ...), else the ones A's bench run judged (its
``goodput`` block), else each request's own as the server stamped them (``tailserve_timing``'s
``slo``). The share of requests meeting every SLO, B - A, gets a bootstrap interval the way
the latency metrics do (requests resampled, or whole runs with replicates on both sides);
B is *worse* when the interval lies below 0, and the gate fails when the relative drop's
interval lies beyond ``--threshold`` percent.

**Capacity** (two ``tailserve bench --sweep`` summaries with SLOs): each target's capacity is
a bracket, [the highest rate measured to meet it, the lowest rate measured to miss it]
(bench/capacity.py). B is *worse* when it missed the target at a rate at or below A's
capacity less ``--threshold`` percent (B failed where A was measured to hold), *better* in
the mirror case, else the brackets overlap: no significant difference at the search's
resolution. The gate fails when B is worse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.analyze.bootstrap import percentile_interval
from tailserve.bench.goodput import SLO_KINDS, SloSpec, judge

WORSE, BETTER, SAME = "worse", "better", "no significant difference"


@dataclass(frozen=True)
class GoodputComparison:
    slos_ms: dict[str, float] | None  # None: each request's own (server timing)
    source: str  # "flags" | "A's bench run" | "server timing"
    a_share: float
    b_share: float
    diff: float  # B - A, share points (0..1)
    ci: tuple[float, float]
    pct: float  # relative to A, percent
    ci_pct: tuple[float, float]
    verdict: str
    gate_failed: bool

    def as_json(self) -> dict[str, Any]:
        return {"slos_ms": self.slos_ms, "source": self.source, "a": self.a_share,
                "b": self.b_share, "diff": self.diff, "ci": list(self.ci), "pct": self.pct,
                "ci_pct": list(self.ci_pct), "verdict": self.verdict,
                "gate": "fail" if self.gate_failed else "pass"}


def request_record(ok: bool, ttft_s: float | None, itl_s: list[float],
                   output_tokens: int | None, e2el_s: float | None,
                   timing: dict[str, Any] | None) -> dict[str, Any]:
    """What the goodput gate needs of one request (RunSamples.requests holds these)."""
    return {"ok": ok, "ttft_s": ttft_s, "itl_s": itl_s, "output_tokens": output_tokens,
            "e2el_s": e2el_s, "slo": (timing or {}).get("slo")}


def file_slos(obj: dict[str, Any]) -> dict[str, float] | None:
    """The SLOs a bench result was judged by (its goodput block), kind -> ms."""
    good = (obj.get("tailserve") or {}).get("goodput")
    if not isinstance(good, dict):
        return None
    slos = {k: float(good[f"{k}_ms"]) for k in SLO_KINDS
            if isinstance(good.get(f"{k}_ms"), (int, float))}
    return slos or None


def _good(rec: dict[str, Any], common: dict[str, float] | None) -> bool | None:
    """None: no SLO known for this request."""
    slos = common
    if not slos:
        stamped = rec.get("slo") or {}
        slos = {k: 1000.0 * float(v) for k in SLO_KINDS
                if isinstance(v := stamped.get(f"{k}_s"), (int, float)) and v > 0}
    if not slos:
        return None
    return judge(SloSpec.from_ms(slos), rec["ok"], rec["ttft_s"], rec["itl_s"],
                 rec["output_tokens"], rec["e2el_s"]).good


def compare_goodput(a: list[list[dict[str, Any]]], b: list[list[dict[str, Any]]],
                    slos: dict[str, float] | None, a_file_slos: dict[str, float] | None,
                    unit: str, confidence: float, threshold_pct: float, num_resamples: int,
                    rng: np.random.Generator) -> GoodputComparison | None:
    """``a``/``b``: per run, its request records. None when no request has an SLO."""
    common = slos or a_file_slos
    source = "flags" if slos else "A's bench run" if a_file_slos else "server timing"
    judged = [[[_good(r, common) for r in run] for run in side] for side in (a, b)]
    if not any(g is not None for side in judged for run in side for g in run):
        return None
    # A request with no SLO of its own is not judged; a failed one is never good.
    sides = [[np.array([bool(g) for g in run if g is not None], dtype=float) for run in side]
             for side in judged]
    if any(sum(len(r) for r in side) == 0 for side in sides):
        return None
    boot = [_boot_share(side, unit, num_resamples, rng) for side in sides]
    point = [float(np.concatenate(side).mean()) for side in sides]
    d = boot[1] - boot[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = 100.0 * d / boot[0]
    ci = percentile_interval(d, confidence)
    ci_pct = percentile_interval(rel, confidence)
    pct = 100.0 * (point[1] - point[0]) / point[0] if point[0] else float("nan")
    verdict = WORSE if ci[1] < 0 else BETTER if ci[0] > 0 else SAME
    # Higher is better: the gate fails when confident that B dropped by more than the
    # threshold (a NaN bound, A's share 0, compares False and never fails it alone).
    gate = verdict == WORSE and bool(ci_pct[1] < -threshold_pct)
    return GoodputComparison(common, source, point[0], point[1], point[1] - point[0], ci, pct,
                             ci_pct, verdict, gate)


def _boot_share(runs: list[np.ndarray], unit: str, num_resamples: int,
                rng: np.random.Generator) -> np.ndarray:
    """[num_resamples] goodput shares: requests drawn (pooled), or whole runs drawn."""
    if unit == "runs":
        good = np.array([r.sum() for r in runs])
        sent = np.array([len(r) for r in runs], dtype=float)
        pick = rng.integers(0, len(runs), size=(num_resamples, len(runs)))
        return good[pick].sum(axis=1) / np.maximum(sent[pick].sum(axis=1), 1.0)
    pooled = np.concatenate(runs)
    pick = rng.integers(0, len(pooled), size=(num_resamples, len(pooled)))
    return pooled[pick].mean(axis=1)


# ------------------------------------------------------------------ capacity of two sweeps
@dataclass(frozen=True)
class CapacityComparison:
    target: float
    a_rate: float | None  # the highest rate measured to meet the target
    a_missed_at: float | None  # the lowest rate measured to miss it
    b_rate: float | None
    b_missed_at: float | None
    verdict: str
    gate_failed: bool

    @property
    def ratio(self) -> float | None:
        return self.b_rate / self.a_rate if self.a_rate and self.b_rate is not None else None

    def as_json(self) -> dict[str, Any]:
        return {"target": self.target, "a_capacity_req_s": self.a_rate,
                "a_lowest_missing_rate": self.a_missed_at, "b_capacity_req_s": self.b_rate,
                "b_lowest_missing_rate": self.b_missed_at, "ratio": self.ratio,
                "verdict": self.verdict, "gate": "fail" if self.gate_failed else "pass"}


def load_capacity(path: str) -> dict[str, Any] | None:
    """A ``bench --sweep`` summary's capacity block; None when the file has none."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    cap = obj.get("capacity") if isinstance(obj, dict) else None
    return cap if isinstance(cap, dict) and isinstance(cap.get("targets"), list) else None


def compare_capacity(a: dict[str, Any], b: dict[str, Any], threshold_pct: float
                     ) -> list[CapacityComparison]:
    """One comparison per target both sweeps searched (module docstring)."""
    bt = {float(t["target"]): t for t in b["targets"]}
    out = []
    keep = 1.0 - threshold_pct / 100.0
    for ta in a["targets"]:
        target = float(ta["target"])
        tb = bt.get(target)
        if tb is None:
            continue
        ar, am = ta["capacity_req_s"], ta["lowest_missing_rate"]
        br, bm = tb["capacity_req_s"], tb["lowest_missing_rate"]
        worse = bm is not None and ar is not None and bm <= ar * keep
        better = am is not None and br is not None and am <= br * keep
        verdict = WORSE if worse else BETTER if better else SAME
        out.append(CapacityComparison(target, ar, am, br, bm, verdict, worse))
    return out


def render_slo_gates(goodput: GoodputComparison | None, capacity: list[CapacityComparison],
                     confidence: float, console: Any) -> None:
    colour = {WORSE: "red", BETTER: "green", SAME: "dim"}
    if goodput is not None:
        g = goodput
        slos = (", ".join(f"{k.upper()} <= {v:g} ms" for k, v in g.slos_ms.items())
                if g.slos_ms else "each request's own SLOs")
        console.print(
            f"[bold]goodput[/] ({slos}, from {g.source}): A {100 * g.a_share:.1f}% -> "
            f"B {100 * g.b_share:.1f}% of requests meet every SLO; Δ {100 * g.diff:+.1f} points "
            f"[{100 * g.ci[0]:+.1f}, {100 * g.ci[1]:+.1f}] at {100 * confidence:g}%: "
            f"[{colour[g.verdict]}]{g.verdict}[/]")
    for c in capacity:
        def show(rate: float | None, miss: float | None) -> str:
            r = "none" if rate is None else f"{rate:.3g}"
            return r + ("" if miss is None else f" (missed at {miss:.3g})")

        ratio = "" if c.ratio is None else f", B/A {c.ratio:.2f}x"
        console.print(f"[bold]capacity[/] at >= {100 * c.target:g}%: A "
                      f"{show(c.a_rate, c.a_missed_at)} req/s, B "
                      f"{show(c.b_rate, c.b_missed_at)} req/s{ratio}: "
                      f"[{colour[c.verdict]}]{c.verdict}[/]")
