"""Time windows where the P99 jumps, and what changed in the same window.

The run is cut into equal bins (about 20, at least 1 s each). A bin whose P99 of TTFT, ITL or
E2EL is more than ``JUMP_FACTOR`` times that metric's typical bin P99 (the median over bins)
is a jump; adjacent jump bins merge into one window. For each window the seed's joined view:
arrival rate, prompt-length mix, KV usage, waiting queue, preemptions, errors and memory (the
GPU's NVML used share too, when the bench recorded it),
each beside its value in the ordinary bins, so what moved with the latency stands out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.analyze.data import RunData
from tailserve.analyze.samples import Samples

JUMP_FACTOR = 2.0
JUMP_MIN_S = 1e-3
NUM_BINS = 20
MIN_BIN_S = 1.0
CHANGE_FACTOR = 1.5  # a quantity "changed" when it moved this much against the baseline


def bin_edges(run: RunData) -> np.ndarray:
    start = run.start_time or 0.0
    width = max(MIN_BIN_S, run.duration_s / NUM_BINS)
    n = max(1, int(np.ceil(run.duration_s / width)))
    return start + width * np.arange(n + 1)


def _p99_by_bin(s: Samples, edges: np.ndarray) -> np.ndarray:
    out = np.full(len(edges) - 1, np.nan)
    b = np.digitize(s.t, edges) - 1
    for i in range(len(out)):
        v = s.values[(b == i) & ~np.isnan(s.values)]
        if len(v) >= 3:
            out[i] = np.percentile(v, 99)
    return out


# Memory in a window is its peak; the other figures are means.
PEAKS = ("rss_mb", "gpu_used_share")


def _bin_stats(run: RunData, edges: np.ndarray) -> dict[str, np.ndarray]:
    n = len(edges) - 1
    width = edges[1] - edges[0]
    reqs = [q for q in run.requests if q.send_t is not None]
    send = np.array([q.send_t for q in reqs], dtype=float)
    plen = np.array([q.prompt_len for q in reqs], dtype=float)
    failed = np.array([not q.ok for q in reqs], dtype=bool)
    long_cut = float(np.percentile(plen, 90)) if len(plen) else 0.0
    if len(plen) and long_cut <= np.median(plen):
        long_cut = float(np.max(plen)) + 1.0  # no long tail of prompts: nothing is "long"
    b = np.digitize(send, edges) - 1
    st: dict[str, np.ndarray] = {k: np.full(n, np.nan) for k in (
        "arrival_rate", "prompt_tokens_mean", "long_prompt_share", "errors", "kv_usage",
        "waiting", "preemptions", "rss_mb")}
    for i in range(n):
        m = b == i
        st["arrival_rate"][i] = m.sum() / width
        st["errors"][i] = float(failed[m].sum())
        if m.any():
            st["prompt_tokens_mean"][i] = plen[m].mean()
            st["long_prompt_share"][i] = float((plen[m] >= long_cut).mean())
    steps = run.steps
    if (steps is None or not len(steps)) and run.samples:
        _stats_from_samples(run.samples, edges, st)
    elif steps is not None and len(steps):
        sb = np.digitize(steps.t, edges) - 1
        kv = steps.kv_usage
        for i in range(n):
            m = sb == i
            if m.any():
                st["kv_usage"][i] = kv[m].mean()
                st["waiting"][i] = steps.waiting[m].mean()
                st["preemptions"][i] = steps.preemptions[m].sum()
                rss = steps.rss[m]
                if (~np.isnan(rss)).any():
                    st["rss_mb"][i] = np.nanmax(rss) / 2**20
    if run.gpu_samples:
        st["gpu_used_share"] = _gpu_by_bin(run.gpu_samples, edges)
    return st


def _gpu_by_bin(gpu_samples: list[dict[str, Any]], edges: np.ndarray) -> np.ndarray:
    """The fullest device's NVML used share in each bin (the bench's GPU watermark samples,
    analyze/gpu_memory.py): memory is judged by its peak, not its mean."""
    out = np.full(len(edges) - 1, np.nan)
    for x in gpu_samples:
        fr = [float(d["used_bytes"]) / float(d["total_bytes"]) for d in x.get("devices") or []
              if isinstance(d, dict) and isinstance(d.get("used_bytes"), (int, float))
              and isinstance(d.get("total_bytes"), (int, float)) and d["total_bytes"] > 0]
        i = int(np.digitize(float(x.get("t") or 0.0), edges)) - 1
        if fr and 0 <= i < len(out):
            out[i] = max(fr) if np.isnan(out[i]) else max(out[i], max(fr))
    return out


def _gauge(values: dict[str, float], *names: str) -> float | None:
    for key, v in values.items():
        base = key.split("{")[0].split(":")[-1]
        if base in names:
            return v
    return None


def _stats_from_samples(samples: list[dict[str, Any]], edges: np.ndarray,
                        st: dict[str, np.ndarray]) -> None:
    """No step timeline (another server, say vLLM): the /metrics samples the bench took, once
    a second or so, still show KV usage, the waiting queue, preemptions and memory."""
    rows = sorted((float(x["t"]), x["values"]) for x in samples if x.get("values"))
    b = np.digitize([t for t, _ in rows], edges) - 1
    prev_pre = None
    acc: dict[str, list[list[float]]] = {k: [[] for _ in range(len(edges) - 1)]
                                         for k in ("kv_usage", "waiting", "preemptions", "rss_mb")}
    for (_, v), i in zip(rows, b, strict=True):
        kv = _gauge(v, "kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage")
        waiting = _gauge(v, "num_requests_waiting", "num_queue_reqs", "requests_deferred")
        pre = _gauge(v, "num_preemptions_total")
        rss = _gauge(v, "process_resident_memory_bytes")
        if not 0 <= i < len(edges) - 1:
            prev_pre = pre if pre is not None else prev_pre
            continue
        for key, x in (("kv_usage", kv), ("waiting", waiting),
                       ("rss_mb", None if rss is None else rss / 2**20)):
            if x is not None:
                acc[key][i].append(x)
        if pre is not None and prev_pre is not None:
            acc["preemptions"][i].append(max(0.0, pre - prev_pre))  # a counter: the increase
        prev_pre = pre if pre is not None else prev_pre
    for key, per_bin in acc.items():
        for j, xs in enumerate(per_bin):
            if xs:
                st[key][j] = (sum(xs) if key == "preemptions" else
                              max(xs) if key == "rss_mb" else float(np.mean(xs)))


def find_windows(run: RunData, samples: dict[str, Samples]) -> list[dict[str, Any]]:
    if run.start_time is None or run.duration_s <= 0:
        return []
    edges = bin_edges(run)
    p99 = {m: _p99_by_bin(s, edges) for m, s in samples.items() if m in ("ttft", "itl", "e2el")}
    jump = np.zeros(len(edges) - 1, dtype=bool)
    base = {}
    for m, v in p99.items():
        if np.isnan(v).all():
            continue
        base[m] = float(np.nanmedian(v))
        jump |= np.nan_to_num(v) > np.maximum(JUMP_FACTOR * base[m], base[m] + JUMP_MIN_S)
    if not jump.any() or jump.all():
        return []
    st = _bin_stats(run, edges)
    out = []
    i = 0
    while i < len(jump):
        if not jump[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(jump) and jump[j + 1]:
            j += 1
        sel = np.zeros(len(jump), dtype=bool)
        sel[i:j + 1] = True
        out.append(_window(run, edges, sel, jump, p99, base, st))
        i = j + 1
    return out


def _window(run: RunData, edges: np.ndarray, sel: np.ndarray, jump: np.ndarray,
            p99: dict[str, np.ndarray], base: dict[str, float],
            st: dict[str, np.ndarray]) -> dict[str, Any]:
    start = run.start_time or 0.0
    lat = {}
    for m, v in p99.items():
        if m in base and not np.isnan(v[sel]).all():
            lat[m] = {"p99_ms": round(float(np.nanmax(v[sel])) * 1e3, 3),
                      "baseline_p99_ms": round(base[m] * 1e3, 3)}
    changes: dict[str, dict[str, float | None]] = {}
    moved = []
    for k, v in st.items():
        w, b = v[sel], v[~jump]
        wv = None if np.isnan(w).all() else float(np.nanmax(w) if k in PEAKS else
                                                 np.nanmean(w))
        bv = None if np.isnan(b).all() else float(np.nanmean(b))
        changes[k] = {"window": None if wv is None else round(wv, 4),
                      "baseline": None if bv is None else round(bv, 4)}
        if wv is not None and bv is not None and (
                (bv > 0 and wv > CHANGE_FACTOR * bv) or (bv == 0 and wv > 0)):
            moved.append(k.replace("_", " "))
    t0 = float(edges[np.flatnonzero(sel)[0]] - start)
    t1 = float(edges[np.flatnonzero(sel)[-1] + 1] - start)
    jumped = ", ".join(f"{m.upper()} P99 {d['p99_ms']:.1f} ms (usually "
                       f"{d['baseline_p99_ms']:.1f})" for m, d in lat.items()
                       if d["p99_ms"] > JUMP_FACTOR * d["baseline_p99_ms"])
    what = ("; rose with it: " + ", ".join(moved)) if moved else \
        "; nothing recorded changed with it"
    return {"start_s": round(t0, 2), "end_s": round(t1, 2), "latency": lat,
            "changes": changes, "changed": moved,
            "summary": f"t={t0:.1f}–{t1:.1f} s: {jumped}{what}"}
