"""``tailserve diagnose --html``: one self-contained file, findings first, then the plots.

Everything is inline (CSS in a <style>, plots as base64 PNG <img> data URIs), so the file
opens offline, from a mail attachment or a CI artifact. PNG rather than SVG: a scatter of
every ITL gap of a long run is megabytes of SVG paths and a few dozen kilobytes of PNG.

Plots: latency over time with P50/P90/P99 bands; CDFs; TTFT against prompt length; queue time
against KV usage; step time against batch composition; a memory / KV-pressure heatmap over
time (viridis, as the seed draws it).
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING, Any

import numpy as np

from tailserve.analyze.data import BLOCKED_KV
from tailserve.analyze.diagnose import NAMES, Diagnosis, headline
from tailserve.analyze.ttft_parts import plot_slowest, table_html
from tailserve.analyze.windows import bin_edges

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_DOTS = 20_000
PLOTS = ("latency_over_time", "cdf", "ttft_vs_prompt", "ttft_parts", "queue_vs_kv",
         "step_vs_batch", "pressure_heatmap")
CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}table{border-collapse:collapse;
margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .5em;font-size:.9em;vertical-align:top}
th{background:#f3f3f3}.findings li{margin:.3em 0}.note{color:#666}img{max-width:100%}"""


def png_base64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _rel(d: Diagnosis, t: np.ndarray) -> np.ndarray:
    return np.asarray(t, dtype=float) - (d.run.start_time or 0.0)


def _latency_over_time(d: Diagnosis, plt: Any) -> Figure | None:
    metrics = [m for m in ("ttft", "itl", "e2el") if m in d.samples and len(d.samples[m].t)]
    if not metrics or d.run.start_time is None:
        return None
    edges = bin_edges(d.run)
    fig, axes = plt.subplots(len(metrics), 1, figsize=(10, 2.6 * len(metrics)), squeeze=False)
    for ax, m in zip(axes[:, 0], metrics, strict=True):
        s = d.samples[m]
        x, y = _rel(d, s.t), s.values * 1e3
        # The bands use every sample; the dots at most MAX_DOTS of them (a long run has a
        # million ITL gaps, which would take matplotlib minutes and show nothing more).
        dots = np.random.default_rng(0).permutation(len(x))[:MAX_DOTS]
        ax.scatter(x[dots], y[dots], s=3, alpha=0.25, color="#555")
        b = np.digitize(s.t, edges) - 1
        mids = (edges[:-1] + edges[1:]) / 2 - edges[0]
        bands = np.full((3, len(mids)), np.nan)
        for i in range(len(mids)):
            v = y[b == i]
            if len(v):
                bands[:, i] = np.percentile(v, [50, 90, 99])
        ax.fill_between(mids, bands[0], bands[2], alpha=0.2, color="tab:red", label="P50–P99")
        for k, (q, c) in enumerate((("P50", "tab:blue"), ("P90", "tab:orange"),
                                    ("P99", "tab:red"))):
            ax.plot(mids, bands[k], color=c, label=q)
        for w in d.windows:
            ax.axvspan(w["start_s"], w["end_s"], color="gold", alpha=0.25)
        ax.set_ylabel(f"{NAMES[m]} (ms)")
        ax.set_yscale("log")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("time since start (s); shaded gold: P99 jump windows")
    return fig


def _cdf(d: Diagnosis, plt: Any) -> Figure | None:
    if not d.samples:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for m, s in d.samples.items():
        v = np.sort(s.values[~np.isnan(s.values)]) * 1e3
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=NAMES[m])
    ax.axhline(d.percentile / 100.0, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of samples")
    if ax.lines[1:]:
        ax.legend()
    return fig


def _ttft_vs_prompt(d: Diagnosis, plt: Any) -> Figure | None:
    s = d.samples.get("ttft")
    if s is None or not len(s.values):
        return None
    reqs = d.run.requests
    plen = np.array([reqs[int(i)].prompt_len for i in s.req], dtype=float)
    queue = np.array([float((reqs[int(i)].timing or {}).get("queue_s") or 0.0) for i in s.req])
    fig, ax = plt.subplots(figsize=(10, 3.5))
    sc = ax.scatter(plen, s.values * 1e3, c=queue * 1e3, cmap="viridis", s=10)
    fig.colorbar(sc, ax=ax, label="queue time (ms)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    return fig


def _queue_vs_kv_gauges(d: Diagnosis, plt: Any) -> Figure | None:
    """Another engine: its KV usage and waiting gauges at each send, against the queue time
    fitted from TTFT, or measured by vLLM's request spans (span_parts.py)."""
    sr, s = d.run.series, d.samples.get("ttft")
    key = next((k for k in ("kv_usage", "kv_usage_old") if sr is not None and sr.has(k)), None)
    if sr is None or s is None or key is None or not len(s.values) or np.isnan(s.t).any():
        return None
    kv = np.interp(s.t, sr.t, np.nan_to_num(sr.value[key])) * 100
    waiting = np.interp(s.t, sr.t, np.nan_to_num(sr.value.get("waiting", np.zeros(len(sr)))))
    queue = (s.parts.get("queueing", 0.0) + s.parts.get("kv_cache_pressure", 0.0)) * 1e3
    fig, ax = plt.subplots(figsize=(10, 3.5))
    sc = ax.scatter(kv, np.broadcast_to(queue, kv.shape), c=waiting, cmap="viridis", s=10)
    fig.colorbar(sc, ax=ax, label="waiting requests at send")
    ax.set_xlabel("KV cache usage at send (%)")
    ax.set_ylabel("queue time, from vLLM's spans (ms)" if d.run.has_spans
                  else "queue time, fitted from TTFT (ms)")
    return fig


def _queue_vs_kv(d: Diagnosis, plt: Any) -> Figure | None:
    steps = d.run.steps
    reqs = [q for q in d.run.requests if q.timing and q.arrival_t is not None]
    if steps is None or not len(steps) or not reqs:
        return _queue_vs_kv_gauges(d, plt)
    arr = np.array([q.arrival_t for q in reqs], dtype=float)
    idx = np.clip(np.searchsorted(steps.t, arr), 0, len(steps) - 1)
    kv = steps.kv_usage[idx] * 100
    queue = np.array([float((q.timing or {}).get("queue_s") or 0.0) for q in reqs]) * 1e3
    fig, ax = plt.subplots(figsize=(10, 3.5))
    sc = ax.scatter(kv, queue, c=steps.waiting[idx], cmap="viridis", s=10)
    fig.colorbar(sc, ax=ax, label="waiting requests at arrival")
    ax.set_xlabel("KV cache usage at arrival (%)")
    ax.set_ylabel("queue time (ms)")
    return fig


def _step_vs_batch(d: Diagnosis, plt: Any) -> Figure | None:
    steps = d.run.steps
    if steps is None or not len(steps):
        return None
    fig, ax = plt.subplots(figsize=(10, 3.5))
    sc = ax.scatter(steps.prefill, steps.step_s * 1e3, c=steps.decode, cmap="viridis", s=8)
    fig.colorbar(sc, ax=ax, label="decode sequences in the step")
    if d.model is not None and d.model.stall.any():
        st = d.model.stall > 0
        ax.scatter(steps.prefill[st], steps.step_s[st] * 1e3, facecolors="none",
                   edgecolors="red", s=40, label="engine stall")
        ax.legend()
    ax.set_xlabel("prefill tokens in the step")
    ax.set_ylabel("step time (ms)")
    return fig


def _pressure_heatmap(d: Diagnosis, plt: Any) -> Figure | None:
    steps = d.run.steps
    if steps is None or not len(steps) or d.run.start_time is None:
        return None
    edges = bin_edges(d.run)
    b = np.digitize(steps.t, edges) - 1
    kvb = np.array([x == BLOCKED_KV for x in steps.blocked_by], dtype=float)
    rows = {"KV usage (%)": steps.kv_usage * 100, "waiting": steps.waiting,
            "running": steps.running,
            "blocked by KV": kvb, "preemptions": steps.preemptions,
            "RSS (MiB)": steps.rss / 2**20}
    grid = np.full((len(rows), len(edges) - 1), np.nan)
    labels = []
    for r, (name, v) in enumerate(rows.items()):
        for i in range(grid.shape[1]):
            m = (b == i) & ~np.isnan(v)
            if m.any():
                grid[r, i] = v[m].sum() if name == "preemptions" else v[m].mean()
        lo, hi = np.nanmin(grid[r]) if not np.isnan(grid[r]).all() else 0.0, \
            np.nanmax(grid[r]) if not np.isnan(grid[r]).all() else 0.0
        labels.append(f"{name} [{lo:.3g}–{hi:.3g}]")
        # Each row on its own scale: the picture is *when* each pressure rises.
        grid[r] = (grid[r] - lo) / (hi - lo) if hi > lo else 0.0 * grid[r]
    fig, ax = plt.subplots(figsize=(10, 3))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                   extent=(0.0, float(edges[-1] - edges[0]), len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel("time since start (s)")
    fig.colorbar(im, ax=ax, label="row-normalized")
    return fig


_BUILDERS = {"latency_over_time": _latency_over_time, "cdf": _cdf,
             "ttft_vs_prompt": _ttft_vs_prompt, "ttft_parts": plot_slowest,
             "queue_vs_kv": _queue_vs_kv,
             "step_vs_batch": _step_vs_batch, "pressure_heatmap": _pressure_heatmap}
_TITLES = {"latency_over_time": "Latency over time with percentile bands",
           "cdf": "Latency CDFs", "ttft_vs_prompt": "TTFT against prompt length",
           "ttft_parts": "The slowest first tokens, by part",
           "queue_vs_kv": "Queue time against KV cache usage",
           "step_vs_batch": "Step time against batch composition",
           "pressure_heatmap": "Memory and KV pressure over time"}


def render_html(d: Diagnosis) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>tailserve diagnose"
             f"</title><style>{CSS}</style></head><body><h1>tailserve diagnose</h1>",
             f"<p class='note'>{e(headline(d))}; the tail is every sample at or above "
             f"P{d.percentile:g}.</p>",
             *(f"<p class='note'>{e(n)}</p>" for n in d.run.notes),
             "<h2>Findings</h2><ul class='findings'>",
             *(f"<li>{e(f)}</li>" for f in d.findings), "</ul>"]
    if d.replicas:
        cols = [k for k in d.replicas[0] if k != "index"]
        parts.append("<h2>Replicas</h2><table><tr>"
                     + "".join(f"<th>{e(k)}</th>" for k in cols) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(str(r.get(k)))}</td>" for k in cols) + "</tr>"
                  for r in d.replicas]
        parts.append("</table>")
    for m, t in d.tails.items():
        parts.append(f"<h2>{NAMES[m]}: P50 {t.p50_s * 1e3:.2f} ms, P99 {t.p99_s * 1e3:.2f} ms"
                     f"</h2><p class='note'>A cause is named when it adds more than "
                     f"{max(t.noise_s, t.floor_s) * 1e3:.1f} ms per tail sample: the run's own "
                     f"noise at this percentile is {t.noise_s * 1e3:.1f} ms, the floor "
                     f"{t.floor_s * 1e3:g} ms.</p><table><tr><th>cause</th><th>share</th>"
                     "<th>evidence</th><th>advice</th></tr>")
        for c in t.causes:
            basis = f"<br><span class='note'>from {e(c.basis)}</span>" if c.basis else ""
            parts.append(f"<tr><td>{e(c.cause)}</td><td>{c.share:.0%}</td><td>{e(c.text)}"
                         f"{basis}</td><td>{e(c.advice)}</td></tr>")
        parts.append("</table>")
    if d.windows:
        parts.append("<h2>Windows where the P99 jumps</h2><ul>")
        parts += [f"<li>{e(w['summary'])}</li>" for w in d.windows]
        parts.append("</ul>")
    for name in PLOTS:
        fig = _BUILDERS[name](d, plt)
        parts.append(f"<h2>{_TITLES[name]}</h2>")
        if fig is None:
            parts.append(f"<p class='note' id='plot-{name}'>not available: the result has no "
                         "server timeline or timing for it.</p>")
            continue
        parts.append(f"<img id='plot-{name}' alt='{_TITLES[name]}' "
                     f"src='data:image/png;base64,{png_base64(fig)}'>")
        plt.close(fig)
        if name == "ttft_parts":
            parts.append(table_html(d))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(d: Diagnosis, path: str) -> None:
    text = render_html(d)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise ValueError(f"cannot write --html {path}: {exc}") from None
