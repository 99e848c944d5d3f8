"""``tailserve tune --html``: the trade-off as one self-contained page, made the way
``diagnose --html`` makes its report (analyze/report.py: inline CSS, plots as base64 PNG).

Plots: P99 ITL against P99 TTFT for every grid point, the latency front joined, the SLO box
dashed and the recommended point starred; the goodput share of each point (with
``tune --capacity``: its capacities at 90% and 99%); then the table, whose ``front`` marks are
the goodput front (analyze/tradeoff.py) the recommendation is chosen on.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from tailserve.analyze.report import CSS, png_base64
from tailserve.analyze.tradeoff import (
    ITL_KEY,
    TTFT_KEY,
    Recommendation,
    Slos,
    goodput_front,
    has_capacity,
    pareto_front,
    usable,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_TABLE = (("median_ttft_ms", "P50 TTFT ms"), (TTFT_KEY, "P99 TTFT ms"),
          ("median_itl_ms", "P50 ITL ms"), (ITL_KEY, "P99 ITL ms"),
          ("goodput_share", "goodput share"), ("request_goodput", "good req/s"),
          ("capacity_90", "capacity @90% req/s"), ("capacity_99", "capacity @99% req/s"),
          ("request_throughput", "req/s"),
          ("output_throughput", "output tok/s"), ("max_scheduled_seqs", "max batch"),
          ("completed", "ok"), ("failed", "failed"))


def point_label(row: dict[str, Any], keys: list[str]) -> str:
    return " ".join(f"{k}={row[k]}" for k in keys)


def _front_plot(rows: list[dict[str, Any]], keys: list[str], front: list[int],
                rec: Recommendation | None, slos: Slos, plt: Any) -> Figure | None:
    pts = [i for i, r in enumerate(rows) if usable(r)]  # a point with no request: no latency
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([rows[i][TTFT_KEY] for i in pts], [rows[i][ITL_KEY] for i in pts],
               color="#999", label="grid point", zorder=2)
    ax.plot([rows[i][TTFT_KEY] for i in front], [rows[i][ITL_KEY] for i in front],
            "o-", color="#1f77b4", label="latency front", zorder=3)
    for i in pts:
        ax.annotate(point_label(rows[i], keys), (rows[i][TTFT_KEY], rows[i][ITL_KEY]),
                    textcoords="offset points", xytext=(4, 4), fontsize=7, color="#444")
    ax.axvline(slos.ttft_ms, color="#d62728", ls="--", lw=1, label="SLO")
    ax.axhline(slos.itl_ms, color="#d62728", ls="--", lw=1)
    if rec is not None:
        r = rows[rec.index]
        ax.scatter([r[TTFT_KEY]], [r[ITL_KEY]], marker="*", s=320, color="#ff7f0e",
                   edgecolor="k", zorder=4, label="recommended")
    ax.set_xlabel("P99 TTFT (ms)")
    ax.set_ylabel("P99 ITL (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _goodput_plot(rows: list[dict[str, Any]], keys: list[str], rec: Recommendation | None,
                  plt: Any) -> Figure | None:
    if has_capacity(rows):
        return _capacity_plot(rows, keys, rec, plt)
    pts = [i for i, r in enumerate(rows) if r.get("goodput_share") is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.35 * len(pts)))
    colors = ["#ff7f0e" if rec is not None and i == rec.index else "#1f77b4" for i in pts]
    ax.barh([point_label(rows[i], keys) for i in pts],
            [100 * rows[i]["goodput_share"] for i in pts], color=colors)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("goodput share (% of requests sent)")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _capacity_plot(rows: list[dict[str, Any]], keys: list[str], rec: Recommendation | None,
                   plt: Any) -> Figure | None:
    pts = [i for i, r in enumerate(rows) if usable(r)]
    if not pts:
        return None
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(pts)))
    y = np.arange(len(pts))
    for off, key, color, name in ((-0.2, "capacity_90", "#1f77b4", ">= 90% good"),
                                  (0.2, "capacity_99", "#2ca02c", ">= 99% good")):
        ax.barh(y + off, [rows[i].get(key) or 0.0 for i in pts], height=0.4, color=color,
                label=name)
    ax.set_yticks(y, [("* " if rec is not None and i == rec.index else "")
                      + point_label(rows[i], keys) for i in pts])
    ax.invert_yaxis()
    ax.set_xlabel("capacity (req/s; * recommended)")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _cell(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key == "goodput_share":
        return f"{100 * v:.1f}%"
    return f"{v:,.2f}" if isinstance(v, float) else f"{v:,}"


def render_tune_html(rows: list[dict[str, Any]], keys: list[str], slos: Slos,
                     rec: Recommendation | None, workload: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = html.escape
    front, latency_front = goodput_front(rows), pareto_front(rows)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailserve tune</title>"
             f"<style>{CSS}</style></head><body><h1>tailserve tune</h1>",
             f"<p class='note'>{len(rows)} settings, each on a fresh server; workload: "
             f"{e(workload)}. A request is good when its TTFT is at most {slos.ttft_ms:g} ms and "
             f"no token gap exceeds {slos.itl_ms:g} ms.</p>"]
    if rec is None:
        parts.append("<p id='recommended'>No setting completed a request.</p>")
    else:
        parts.append(f"<p id='recommended'><b>Recommended:</b> "
                     f"{e(point_label(rows[rec.index], keys))} -- {e(rec.reason)}.</p>")
    for pid, title, fig in (
            ("front", "P99 ITL against P99 TTFT", _front_plot(rows, keys, latency_front, rec,
                                                              slos, plt)),
            ("goodput", "Capacity" if has_capacity(rows) else "Goodput share",
             _goodput_plot(rows, keys, rec, plt))):
        parts.append(f"<h2>{title}</h2>")
        if fig is None:
            parts.append(f"<p class='note' id='plot-{pid}'>not available: no setting "
                         "completed a request.</p>")
            continue
        parts.append(f"<img id='plot-{pid}' alt='{title}' "
                     f"src='data:image/png;base64,{png_base64(fig)}'>")
        plt.close(fig)
    parts.append("<h2>Every setting</h2><table><tr><th></th>"
                 + "".join(f"<th>{e(k)}</th>" for k in keys)
                 + "".join(f"<th>{t}</th>" for _, t in _TABLE) + "</tr>")
    for i, r in enumerate(rows):
        mark = ("recommended" if rec is not None and i == rec.index
                else "front" if i in front else "")
        cells = "".join(f"<td>{e(str(r[k]))}</td>" for k in keys)
        if "error" in r:
            cells += f"<td colspan='{len(_TABLE)}'>failed: {e(str(r['error'])[:500])}</td>"
        else:
            cells += "".join(f"<td>{_cell(k, r.get(k))}</td>" for k, _ in _TABLE)
            if "failure" in r:
                cells += f"<td>{e(str(r['failure']))}</td>"
        parts.append(f"<tr><td>{mark}</td>{cells}</tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)


def write_tune_html(path: str, rows: list[dict[str, Any]], keys: list[str], slos: Slos,
                    rec: Recommendation | None, workload: str) -> None:
    text = render_tune_html(rows, keys, slos, rec, workload)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise ValueError(f"cannot write --html {path}: {exc}") from None
