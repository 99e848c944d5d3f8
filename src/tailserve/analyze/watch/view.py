"""What a window looks like: a line in the terminal (rich), a JSON line, a dashboard sample.

A bucketed value is written as what the buckets prove: ``120–150 ms`` (the bucket it lies
in), ``> 10 s`` (the +Inf bucket), one number only when exact; the linear estimate inside
the bucket is marked ``~``.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.markup import escape

from tailserve.analyze.watch.hist import Bound
from tailserve.analyze.watch.window import LABEL, MetricWindow, Window


def _ms(x: float) -> str:
    m = x * 1e3
    return f"{m / 1e3:.2f} s" if m >= 1000 else f"{m:.0f} ms" if m >= 10 else f"{m:.1f} ms"


def fmt_latency(b: Bound | None) -> str:
    if b is None:
        return "–"
    if math.isinf(b.high):
        return f"> {_ms(b.low)}"
    if b.exact:
        return _ms(b.high)
    est = "" if b.estimate is None else f" (~{_ms(b.estimate)})"
    return f"{_ms(b.low)}–{_ms(b.high)}{est}"


def fmt_share(b: Bound | None) -> str:
    if b is None:
        return "–"
    lo, hi = 100 * b.low, 100 * b.high
    return f"{lo:.1f}%" if abs(hi - lo) < 0.05 else f"{lo:.1f}–{hi:.1f}%"


def header(url: str, engine: str, interval_s: float, slos_s: dict[str, float],
           notes: list[str]) -> list[str]:
    slo = ", ".join(f"{LABEL[m]} <= {_ms(v)}" for m, v in slos_s.items()) or "none given"
    lines = [f"watching {engine} at {url} every {interval_s:g} s (no load sent); SLO: {slo}"]
    return lines + [f"  cannot judge: {n}" for n in notes]


def _metric_text(mw: MetricWindow) -> str:
    if mw.note:
        return f"{LABEL[mw.metric]} {mw.note}"
    if mw.n == 0:
        return f"{LABEL[mw.metric]} no samples"
    s = f"{LABEL[mw.metric]} P99 {fmt_latency(mw.p99)} (n={mw.n:.0f})"
    if mw.attained is not None:
        s += f" SLO met {fmt_share(mw.attained)}"
    return s


def window_lines(w: Window) -> list[tuple[str, str]]:
    """(style, text) lines for one window: the summary, then each jump and alert."""
    clock = time.strftime("%H:%M:%S", time.localtime(w.t1))
    parts = [_metric_text(mw) for mw in w.metrics.values()]
    sig = w.signals
    gauges = [f"{k} {sig[k]:.0f}" for k in ("running", "waiting") if k in sig]
    if "kv_usage" in sig:
        gauges.append(f"KV {100 * sig['kv_usage']:.0f}%")
    if sig.get("preemptions"):
        gauges.append(f"preempted {sig['preemptions']:.0f}")
    out = [("", f"#{w.index} {clock}  " + " | ".join(parts + ([" ".join(gauges)] if gauges
                                                               else [])))]
    for mw in w.metrics.values():
        if mw.jumped and mw.level_s is not None:
            cause = mw.cause or "cause not named"
            out.append(("bold red", f"  {LABEL[mw.metric]} P99 jumped to {fmt_latency(mw.p99)} "
                        f"(earlier windows: {_ms(mw.level_s)}): {cause}: {mw.why}"))
    for g in w.gpus or ():
        style = "bold red" if g.alert else "dim"
        alert = "  ALERT >= 95%" if g.alert else ""
        out.append((style, f"  GPU{g.index} {g.name}: {g.used_bytes / 2**30:.1f} of "
                    f"{g.total_bytes / 2**30:.1f} GiB ({100 * g.fraction:.0f}%){alert}"))
    if w.memory_gap_bytes is not None:
        out.append(("dim", f"  allocator reserved - allocated: "
                    f"{w.memory_gap_bytes / 2**20:.0f} MiB"))
    return out


def print_window(console: Console, w: Window) -> None:
    for style, text in window_lines(w):
        console.print(escape(text), style=style or None, highlight=False)


def _point(b: Bound | None) -> float | None:
    """One number for a chart: the estimate, else the bucket's lower edge (a floor)."""
    if b is None:
        return None
    return b.estimate if b.estimate is not None else b.low


def dashboard_sample(w: Window, preemptions_total: float, alerts_total: int,
                     url: str) -> dict[str, Any]:
    """The window in the live dashboard's sample shape (server/dashboard/feed.py), plus a
    ``watch`` part the page shows only for watch (SLO shares, jumps and causes)."""
    s: dict[str, Any] = {"t": w.t1}
    sig = w.signals
    for k in ("running", "waiting", "kv_usage"):
        if k in sig:
            s[k] = sig[k]
    for m, mw in w.metrics.items():
        s[f"{m}_p50"], s[f"{m}_p99"], s[f"{m}_n"] = _point(mw.p50), _point(mw.p99), mw.n
    if "steps" in sig:
        s |= {"steps": sig["steps"], "step_p50": sig.get("step_p50_s"),
              "step_p99": sig.get("step_p99_s"), "step_max": sig.get("step_max_s")}
    s["preemptions_total"] = preemptions_total
    if w.gpus:
        s["memory"] = {"device_used": sum(g.used_bytes for g in w.gpus),
                       "device_total": sum(g.total_bytes for g in w.gpus)}
    s["memory_alerts"] = alerts_total
    s["watch"] = {"url": url, "engine": w.engine, "window": w.as_json(),
                  "lines": [text for _, text in window_lines(w)]}
    return s
