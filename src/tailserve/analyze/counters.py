"""Causes judged from an engine's gauges and counters, where there is no step timeline.

The client's clock gives each request's send, first-token and finish times and every gap
between its chunks (samples.client_samples fits queueing, own prefill and interference from
them). The engine's ``/metrics`` samples, once a second or so, add what the client cannot see
(engines/ maps each family's names onto these signals):

- **kv_cache_pressure**: the part of a request's wait for its first token spent in windows
  where requests were waiting (``waiting`` > 0, the mean of the window's two scrapes) while
  the KV cache was near full (``kv_usage`` >= ``KV_FULL`` at either scrape), or at least half
  used with a sequence slot free (fewer running than the run's most): admission was held by
  free blocks, not by a sequence slot.
  That share of the fitted queue time moves from ``queueing`` to ``kv_cache_pressure``.
- **preemption**: a preempted request stops streaming until it is rescheduled and its prompt
  recomputed, so each preemption is one long gap that touches the window where the
  ``preemptions`` counter rose (vLLM 0.32 counts it when the request resumes: the gap *ends*
  there; an engine that counts at the preemption has it *start* there). In every such window
  the counter's increase is charged to that many of the longest gaps overlapping it (longer
  than ``STALL_OVER_MEDIAN`` x the median gap, not yet charged), each by what it took beyond
  the median gap; a request's charged gaps are its E2EL and TPOT part too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.analyze.attribution import time_ranges
from tailserve.analyze.data import RunData
from tailserve.analyze.engines import Series
from tailserve.analyze.samples import Samples, client_samples

KV_FULL = 0.9  # KV usage at or above this, with requests waiting: admission held by blocks
KV_BUSY = 0.5  # ... or at or above this with a sequence slot free (kv_bound)
STALL_OVER_MEDIAN = 2.0  # a gap a preemption could explain is at least this x the median
# The least widening of a counter's window (below); a gap at its edge is still a candidate.
EDGE_S = 0.25


def counter_samples(run: RunData) -> dict[str, Samples]:
    out = client_samples(run)
    sr = run.series
    if sr is None:
        return out
    n = len(run.requests)
    if sr.has("waiting") and _kv(sr) is not None:
        frac = _kv_share(run, sr, n)
        for s in out.values():
            q = s.parts.get("queueing")
            if q is None:
                continue
            f = frac[s.req]
            s.parts["kv_cache_pressure"] = q * f
            s.parts["queueing"] = q * (1.0 - f)
    if "preemptions" in sr.delta and "itl" in out:
        itl = out["itl"]
        part = _preempted_gaps(itl, sr)
        itl.parts["preemption"] = part
        per_req = np.bincount(itl.req, weights=part, minlength=n) if len(part) else np.zeros(n)
        if "e2el" in out:
            out["e2el"].parts["preemption"] = per_req[out["e2el"].req]
        if "tpot" in out:
            s = out["tpot"]
            n_out = np.array([run.requests[int(i)].output_tokens for i in s.req], dtype=float)
            s.parts["preemption"] = per_req[s.req] / np.maximum(n_out - 1.0, 1.0)
    return out


def _kv(sr: Series) -> str | None:
    return next((k for k in ("kv_usage", "kv_usage_old") if sr.has(k)), None)


def kv_bound(sr: Series) -> np.ndarray:
    """Per interval: 1.0 where requests waited while the KV cache was near full, or busy with
    a sequence slot free (fewer running than the run has shown it can run: what held the
    waiting back was blocks; with large blocks "full" is a few blocks short of 100%)."""
    key = _kv(sr)
    if key is None or not sr.has("waiting"):
        return np.zeros(len(sr))
    waiting = np.nan_to_num(sr.interval_mean("waiting"))
    kv = np.nan_to_num(sr.interval_max(key))
    seat = np.zeros(len(sr), dtype=bool)
    if sr.has("running"):
        running = np.nan_to_num(sr.interval_mean("running"))
        seat = running < np.nanmax(sr.value["running"])
    return ((waiting > 0) & ((kv >= KV_FULL) | (seat & (kv >= KV_BUSY)))).astype(float)


def _kv_share(run: RunData, sr: Series, n: int) -> np.ndarray:
    """Per request: the share of its send -> first token span in KV-bound windows."""
    frac = np.zeros(n)
    idx = [i for i, q in enumerate(run.requests)
           if q.ok and q.send_t is not None and q.ttft_s is not None]
    if not idx:
        return frac
    t0 = np.array([run.requests[i].send_t for i in idx], dtype=float)
    t1 = t0 + np.array([run.requests[i].ttft_s for i in idx], dtype=float)
    span = np.maximum(t1 - t0, 1e-9)
    frac[idx] = np.clip(sr.overlap(t0, t1, kv_bound(sr)) / span, 0.0, 1.0)
    return frac


def _preempted_gaps(itl: Samples, sr: Series) -> np.ndarray:
    part = np.zeros(len(itl.values))
    if not len(part):
        return part
    med = float(np.median(itl.values))
    start = itl.t - itl.values
    long = itl.values > STALL_OVER_MEDIAN * med
    lo = np.concatenate([sr.t[:1], sr.t[:-1]])
    # A chunk is stamped on arrival, a step or two from the counter's update: widen by that.
    edge = max(EDGE_S, 2.0 * med)
    for j in np.flatnonzero(sr.delta["preemptions"] > 0):
        k = round(float(sr.delta["preemptions"][j]))
        cand = np.flatnonzero(long & (part == 0) & (start <= sr.t[j] + edge)
                              & (itl.t > lo[j] - edge))
        for g in cand[np.argsort(-itl.values[cand])][:k]:
            part[g] = itl.values[g] - med
    return part


def _ms(x: float) -> float:
    return round(float(x) * 1e3, 3)


def signal_evidence(cause: str, run: RunData) -> dict[str, Any]:
    """The engine's own figures behind a cause judged from its counters and gauges."""
    sr = run.series
    if sr is None:
        return {}
    start = run.start_time or 0.0
    ev: dict[str, Any] = {}
    if cause == "preemption" and "preemptions" in sr.delta:
        d = sr.delta["preemptions"]
        ev["preemptions"] = round(float(d[1:].sum()))
        if d[1:].any():
            ev["preemption_windows_s"] = time_ranges(sr.t[d > 0], start)
    elif cause == "kv_cache_pressure":
        bound = kv_bound(sr)
        key = _kv(sr)
        ev["kv_bound_share_of_run"] = round(float(bound[1:].mean()), 4) if len(sr) > 1 else 0.0
        if key is not None:
            ev["max_kv_usage"] = round(float(np.nanmax(sr.value[key])), 4)
        if bound.any():
            ev["kv_bound_windows_s"] = time_ranges(sr.t[bound > 0], start)
    if cause == "queueing":
        ev |= slot_evidence(run.samples)
    if cause in ("queueing", "kv_cache_pressure") and sr.has("waiting"):
        w = sr.value["waiting"]
        ev["max_waiting"] = int(np.nanmax(w))
    if cause in ("queueing", "kv_cache_pressure") and "queue_count" in sr.delta:
        c, s = sr.delta["queue_count"], sr.delta["queue_sum"]
        if c[1:].sum() > 0:
            ev["server_queue_mean_ms"] = _ms(s[1:].sum() / c[1:].sum())
            per = np.where(c > 0, s / np.maximum(c, 1e-9), 0.0)
            worst = int(np.argmax(per))
            ev |= {"server_queue_worst_window_mean_ms": _ms(per[worst]),
                   "server_queue_worst_window_at_s": round(float(sr.t[worst] - start), 2)}
    if cause == "own_prefill" and "prompt_seconds" in sr.delta:
        tok = float(sr.delta["prompt_tokens"][1:].sum()) if "prompt_tokens" in sr.delta else 0.0
        if tok > 0:
            ev["server_ms_per_1k_prompt_tokens"] = _ms(
                float(sr.delta["prompt_seconds"][1:].sum()) / tok * 1000.0)
    return ev


def slot_evidence(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's /slots at each sample (bench/observe.py): how often every slot was busy
    (a request that arrives then waits for one), and how much of its context the fullest slot
    held (a request past it fails or shifts its context: it never waits for KV)."""
    views = [x["slots"] for x in samples if isinstance(x.get("slots"), list) and x["slots"]]
    if not views:
        return {}
    busy = [sum(1 for s in v if s.get("is_processing")) for v in views]
    use = [(float(s.get("n_prompt_tokens") or 0) + float(s.get("n_decoded") or 0))
           / float(s["n_ctx"]) for v in views for s in v
           if s.get("is_processing") and isinstance(s.get("n_ctx"), (int, float)) and s["n_ctx"]]
    n = max(len(v) for v in views)
    ev: dict[str, Any] = {"slots": n, "all_slots_busy_share": round(
        sum(1 for b, v in zip(busy, views, strict=True) if b >= len(v)) / len(views), 4)}
    if use:
        ev["max_slot_context_use"] = round(max(use), 4)
    return ev
