"""The soak's figures (benchmarks/soak.py): requests by outcome, RSS slopes, P99 TTFT/ITL per
window, KV blocks free at the end; and the verdict against issue 34's targets."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# After warm-up, RSS must grow slower than this (MB per minute) over the fitted span.
MAX_SLOPE_MB_PER_MIN = 0.5
# The slope is fitted over the last FIT_MINUTES minutes (after warm-up), or over the second
# half of a shorter run.
FIT_MINUTES = 40.0
WARMUP_MINUTES = 5.0


@dataclass
class Outcome:
    t: float  # seconds after the start (sent)
    kind: str  # what was sent: normal, disconnect, oversized, malformed, bad_key
    tenant: str
    outcome: str  # ok, wrong_length, disconnected, 4xx:<status>, 5xx:<status>, transport:<exc>
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


@dataclass
class RssSample:
    t: float  # seconds after the start
    process: str  # e.g. "replica0/api", "replica1/engine"
    pid: int
    rss_mb: float
    anon_mb: float  # RssAnon: the heap and other private memory (what a leak grows)
    file_mb: float  # RssFile: mapped files (libraries, weights)


def slope_mb_per_min(ts: list[float], mbs: list[float]) -> float | None:
    if len(ts) < 3 or ts[-1] - ts[0] <= 0:
        return None
    return float(np.polyfit(np.array(ts) / 60.0, np.array(mbs), 1)[0])


def rss_figures(samples: list[RssSample], minutes: float) -> dict[str, Any]:
    """Per process (a restarted replica's processes are new ones: keyed by pid too): first and
    last RSS, anon and file parts, and the slope over the fitted span."""
    out: dict[str, Any] = {}
    by: dict[tuple[str, int], list[RssSample]] = {}
    for s in samples:
        by.setdefault((s.process, s.pid), []).append(s)
    span_s = FIT_MINUTES * 60.0 if minutes > FIT_MINUTES * 1.25 else minutes * 30.0
    for (name, pid), rows in sorted(by.items(), key=lambda kv: (kv[0][0], kv[1][0].t)):
        end = rows[-1].t
        # A process's own warm-up (a restarted replica loads its model under traffic): its
        # first WARMUP_MINUTES, or the first quarter of a shorter life, are not fitted.
        warm = rows[0].t + min(WARMUP_MINUTES * 60.0, (end - rows[0].t) / 4)
        fit = [r for r in rows if r.t >= max(end - span_s, warm)]
        fig = {
            "pid": pid, "from_s": round(rows[0].t), "to_s": round(end),
            "rss_mb": [round(rows[0].rss_mb, 1), round(rows[-1].rss_mb, 1)],
            "anon_mb": [round(rows[0].anon_mb, 1), round(rows[-1].anon_mb, 1)],
            "file_mb": [round(rows[0].file_mb, 1), round(rows[-1].file_mb, 1)],
            "fit_minutes": round((fit[-1].t - fit[0].t) / 60.0, 1) if fit else 0.0,
            "slope_mb_per_min": _round(slope_mb_per_min([r.t for r in fit],
                                                        [r.rss_mb for r in fit])),
            "anon_slope_mb_per_min": _round(slope_mb_per_min([r.t for r in fit],
                                                             [r.anon_mb for r in fit])),
        }
        key = name if name not in out else f"{name}#{pid}"
        out[key] = fig
    return out


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def windows(outcomes: list[Outcome], window_s: float, duration_s: float) -> list[dict[str, Any]]:
    """P99 TTFT and ITL of the streamed requests that succeeded, per window of send time."""
    rows = []
    n = max(1, int(np.ceil(duration_s / window_s)))
    for w in range(n):
        lo, hi = w * window_s, (w + 1) * window_s
        ok = [o for o in outcomes if lo <= o.t < hi and o.outcome == "ok"]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        itl = [g for o in ok for g in o.itl_s]
        rows.append({
            "from_min": round(lo / 60, 1), "to_min": round(min(hi, duration_s) / 60, 1),
            "requests": len([o for o in outcomes if lo <= o.t < hi]), "ok": len(ok),
            "p99_ttft_ms": round(float(np.percentile(ttft, 99)) * 1e3, 1) if ttft else None,
            "p99_itl_ms": round(float(np.percentile(itl, 99)) * 1e3, 1) if itl else None,
        })
    return rows


def summarize(outcomes: list[Outcome], rss: list[RssSample], kv_end: dict[str, Any],
              minutes: float, window_min: float, events: list[dict[str, Any]],
              setup: dict[str, Any]) -> dict[str, Any]:
    by_outcome: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    by_tenant: dict[str, dict[str, int]] = {}
    for o in outcomes:
        by_outcome[o.outcome] = by_outcome.get(o.outcome, 0) + 1
        k = by_kind.setdefault(o.kind, {})
        k[o.outcome] = k.get(o.outcome, 0) + 1
        t = by_tenant.setdefault(o.tenant, {})
        t[o.outcome] = t.get(o.outcome, 0) + 1
    five = sum(v for k, v in by_outcome.items() if k.startswith("5xx"))
    duration_s = max([o.t for o in outcomes], default=0.0)
    rss_fig = rss_figures(rss, minutes)
    slopes = {k: v["slope_mb_per_min"] for k, v in rss_fig.items()}
    verdict = {
        "no_5xx": five == 0,
        "no_wrong_length": by_outcome.get("wrong_length", 0) == 0,
        "kv_all_free": all(r.get("all_free") for r in kv_end.values()) if kv_end else False,
        # Only a run long enough for warm-up to be over judges the slope.
        "rss_slope_below_0.5_mb_per_min": (
            all(s is not None and s < MAX_SLOPE_MB_PER_MIN for s in slopes.values())
            if minutes >= 30 else None),
    }
    return {
        "setup": setup, "minutes": minutes, "requests": len(outcomes),
        "by_outcome": dict(sorted(by_outcome.items())), "by_kind": by_kind,
        "by_tenant": by_tenant, "num_5xx": five,
        "num_wrong_length": by_outcome.get("wrong_length", 0), "events": events,
        "rss": rss_fig, "kv_end": kv_end,
        "windows": windows(outcomes, window_min * 60.0, duration_s), "verdict": verdict,
    }


def print_report(rep: dict[str, Any]) -> None:
    print(f"soak: {rep['requests']} requests in {rep['minutes']:g} min; by outcome "
          f"{json.dumps(rep['by_outcome'])}")
    print(f"  5xx: {rep['num_5xx']}; wrong-length outputs: {rep['num_wrong_length']}")
    for kind, counts in sorted(rep["by_kind"].items()):
        print(f"  {kind:>10}: {json.dumps(counts)}")
    for tenant, counts in sorted(rep["by_tenant"].items()):
        print(f"  tenant {tenant}: {json.dumps(counts)}")
    for e in rep["events"]:
        print(f"  event at {e['t']:.0f} s: {e['what']}")
    print("  RSS (MB, first -> last; slope over the fitted span, MB/min):")
    for name, f in rep["rss"].items():
        print(f"    {name:<16} {f['rss_mb'][0]:8.1f} -> {f['rss_mb'][1]:8.1f}  anon "
              f"{f['anon_mb'][0]:.1f} -> {f['anon_mb'][1]:.1f}  slope {f['slope_mb_per_min']} "
              f"(anon {f['anon_slope_mb_per_min']}) over {f['fit_minutes']} min")
    for name, kv in rep["kv_end"].items():
        print(f"  KV at the end, {name}: {kv}")
    print("  P99 per window (streamed requests that succeeded):")
    for w in rep["windows"]:
        print(f"    {w['from_min']:5.1f}-{w['to_min']:5.1f} min: {w['requests']:5d} sent, "
              f"{w['ok']:5d} ok, TTFT {w['p99_ttft_ms']} ms, ITL {w['p99_itl_ms']} ms")
    print(f"  verdict: {json.dumps(rep['verdict'])}")
