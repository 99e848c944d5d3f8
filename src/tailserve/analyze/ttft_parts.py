"""Per-request TTFT decomposition: what each cause added to one request's first token.

These are the TTFT samples' raw parts (samples.py, counters.py), before attribution compares
them with the median: queue time (split by what held admission: a slot or the token budget,
free KV blocks, a preemption), the request's own prefill, other requests' prefill, stalls,
and client-side time. With tailserve's timing they are *measured* per request; with another
engine's counters they are *fitted* (TTFT against prompt length and the queue ahead of it,
split by the engine's gauges), which the output says; with vLLM's request spans
(``--otlp-traces``, span_parts.py) queue, prefill and client time are *spans*: measured per
request, the prefill split into own and interference by the run's quickest price.
``rest_ms`` is what no part claims (the first decode step, the fitted base, the hop from the
API to vLLM's engine core); parts can overlap a little (a stall during a prefill), so it is
floored at 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tailserve.analyze.diagnose import Diagnosis

ORDER = ("queueing", "kv_cache_pressure", "preemption", "own_prefill", "prefill_interference",
         "engine_stall", "client_or_network")


def decompose_ttft(d: Diagnosis) -> dict[str, Any] | None:
    s = d.samples.get("ttft")
    if s is None or not len(s.values):
        return None
    names = [c for c in ORDER if c in s.parts] + sorted(c for c in s.parts if c not in ORDER)
    start = d.run.start_time or 0.0
    method = "measured" if d.run.has_timing else "spans" if d.run.has_spans else "fitted"
    rows = []
    for k in range(len(s.values)):
        q = d.run.requests[int(s.req[k])]
        parts = {c: round(max(0.0, float(np.nan_to_num(s.parts[c][k]))) * 1e3, 3)
                 for c in names}
        ttft = float(s.values[k]) * 1e3
        rows.append({"request_id": q.request_id,
                     "send_s": None if q.send_t is None else round(q.send_t - start, 3),
                     "prompt_tokens": q.prompt_len, "ttft_ms": round(ttft, 3),
                     "parts_ms": parts, "rest_ms": round(max(0.0, ttft - sum(parts.values())), 3),
                     # A request without a span keeps the fitted parts (a span file that
                     # missed some requests): each row says which it is.
                     "method": "fitted" if method == "spans" and q.span is None else method})
    return {"method": method, "about": ABOUT[method], "parts": names, "requests": rows}


ABOUT = {
    "measured": "tailserve's per-request timing and step timeline",
    "spans": "vLLM's llm_request spans: queue, prefill and server-side TTFT measured per "
             "request; the prefill window split into the prompt's own cost at the run's "
             "quickest price and interference",
    "fitted": "fitted on the client's clock (TTFT against prompt length and the queue ahead), "
              "split by the engine's gauges where recorded",
}


def table_html(d: Diagnosis, n: int = 10) -> str:
    """The ``n`` slowest first tokens as an HTML table of their parts in ms (empty: none)."""
    import html

    dec = decompose_ttft(d)
    if dec is None:
        return ""
    rows = sorted(dec["requests"], key=lambda r: -r["ttft_ms"])[:n]
    names = [c for c in dec["parts"] if any(r["parts_ms"][c] for r in rows)]
    head = "".join(f"<th>{html.escape(c)} (ms)</th>" for c in names)
    body = "".join(
        f"<tr><td>{html.escape(r['request_id'])}</td><td>{r['prompt_tokens']}</td>"
        f"<td>{r['ttft_ms']:.1f}</td>"
        + "".join(f"<td>{r['parts_ms'][c]:.1f}</td>" for c in names)
        + f"<td>{r['rest_ms']:.1f}</td><td>{r['method']}</td></tr>" for r in rows)
    return (f"<p class='note'>Parts from {html.escape(dec['about'])}.</p><table id='ttft-parts'>"
            f"<tr><th>request</th><th>prompt tokens</th><th>TTFT (ms)</th>{head}"
            f"<th>rest (ms)</th><th>method</th></tr>{body}</table>")


def plot_slowest(d: Diagnosis, plt: Any, n: int = 20) -> Any:
    """Stacked bars: the ``n`` slowest first tokens, each split into its parts."""
    dec = decompose_ttft(d)
    if dec is None:
        return None
    rows = sorted(dec["requests"], key=lambda r: -r["ttft_ms"])[:n][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.2))
    left = np.zeros(len(rows))
    cmap = plt.get_cmap("viridis")
    names = [*dec["parts"], "rest"]
    for i, name in enumerate(names):
        w = np.array([r["rest_ms"] if name == "rest" else r["parts_ms"][name] for r in rows])
        if not w.any():
            continue
        ax.barh(range(len(rows)), w, left=left, label=name,
                color="#bbb" if name == "rest" else cmap(i / max(len(names) - 1, 1)))
        left += w
    ax.set_yticks(range(len(rows)), [r["request_id"] for r in rows], fontsize=6)
    ax.set_xlabel(f"TTFT (ms), {dec['method']} parts")
    ax.legend(fontsize=7, loc="lower right")
    return fig
