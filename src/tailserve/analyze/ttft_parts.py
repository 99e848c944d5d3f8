"""Per-request TTFT decomposition: what each cause added to one request's first token.

These are the TTFT samples' raw parts (samples.py, counters.py), before attribution compares
them with the median: queue time (split by what held admission: a slot or the token budget,
free KV blocks, a preemption), the request's own prefill, other requests' prefill, stalls,
and client-side time. With tailserve's timing they are *measured* per request; with another
engine's counters they are *fitted* (TTFT against prompt length and the queue ahead of it,
split by the engine's gauges), which the output says. ``rest_ms`` is what no part claims (the
first decode step, the fitted base); parts can overlap a little (a stall during a prefill),
so it is floored at 0.
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
    rows = []
    for k in range(len(s.values)):
        q = d.run.requests[int(s.req[k])]
        parts = {c: round(max(0.0, float(np.nan_to_num(s.parts[c][k]))) * 1e3, 3)
                 for c in names}
        ttft = float(s.values[k]) * 1e3
        rows.append({"request_id": q.request_id,
                     "send_s": None if q.send_t is None else round(q.send_t - start, 3),
                     "prompt_tokens": q.prompt_len, "ttft_ms": round(ttft, 3),
                     "parts_ms": parts, "rest_ms": round(max(0.0, ttft - sum(parts.values())), 3)})
    return {"method": "measured" if d.run.has_timing else "fitted", "parts": names,
            "requests": rows}


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
