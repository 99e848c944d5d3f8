"""The ``cpu_contention`` cause: other work on the server's host took the CPU it computes on.

bench, run on the server's host, records the host's busy CPU time, the server's process tree's
and its own at every ``/metrics`` sample, and where the kernel keeps them the server's threads'
run and run-queue wait times (bench/host_cpu.py). Per window between two samples:

- ``f``, the others' share = (host busy − server − client) / the host's CPU capacity: the
  fraction of every core that went to other processes (and other guests, as steal);
- ``g``, the server's wait share = the time its threads waited runnable for a CPU over the
  time they were runnable.

A server that computes on every core keeps ``1 − f`` of them, so a latency L measured over a
window with share f would have been L·(1 − f) alone: f·L of it is lost. But a server whose
threads spin while they wait for each other (OpenMP's barriers, tailserve's work pool) keeps
most of its CPU time under contention and only gets slower, so f understates what it lost
(measured here: 8 busy loops beside vLLM on 2 cores left it 1.4 cores of CPU time, f = 0.3,
while its TTFT grew 9x), and its threads' wait share less so. Where others took at least
``MIN_OTHER`` of the host, the lost share is the larger of f and g less g's level in the
run's quiet windows (the server's threads also wait for each other's cores, others or not);
in a quiet window it is none.
Each sample's ``cpu_contention`` part is its value times that share, time-weighted over the
sample's own interval (the gap for ITL, send to first token for TTFT, send to finish for
E2EL, first token to finish for TPOT).

Neither share is the slowdown itself: a pool of threads that meet at a barrier every layer
progresses only while all of them hold a core, so losing a third of its CPU time can make it
several times slower (beside 16 loops vLLM's wait share went only from 0.37 to 0.55 while its
ITL grew 15x). So where the
run has quiet samples of the metric (at least ``MIN_QUIET_SAMPLES`` whose intervals saw no
contended window), the part is at least the counterfactual: the sample's excess over the
quiet samples' median, for the share of its interval that was contended.

On tailserve's timeline the same slowness shows as steps slower than the step model
(``engine_stall``), and the client beside the server is slowed too (``client_or_network``);
the part contention explains moves from those to it, so a slow host is not blamed on the
engine or the network. The attribution's floors (attribution.py) keep the few percent a quiet
host's daemons take from ever being named. Without host samples (bench elsewhere, no /proc)
the cause is listed as one diagnose cannot judge.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from tailserve.analyze.data import RunData
from tailserve.analyze.samples import Samples

CAUSE = "cpu_contention"
# Others' share of the host below which a window counts as quiet (a host's daemons, the
# kernel's own threads).
MIN_OTHER = 0.05
# Samples of a metric from quiet windows needed before their median is the reference.
MIN_QUIET_SAMPLES = 5
# What the host's slowness shows up as, without its cause: steps slower than the step model,
# and (bench runs on the same host) a client slower to send and read.
TAKES_FROM = ("engine_stall", "client_or_network")


def host_windows(samples: list[dict[str, Any]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per window between consecutive host samples: (start, end, others' share of the host's
    CPU in [0, 1], the server's wait share); the wait share is the time its threads waited
    runnable for a CPU over the time they were runnable (NaN where the samples carry no
    schedstat). Empty arrays with fewer than two samples."""
    xs = sorted((x for x in samples if _complete(x)), key=lambda x: float(x["t"]))
    t0, t1, f, g = [], [], [], []
    for a, b in itertools.pairwise(xs):
        cap = float(b["host_all_s"]) - float(a["host_all_s"])
        if cap <= 0 or float(b["t"]) <= float(a["t"]):
            continue
        busy = float(b["host_busy_s"]) - float(a["host_busy_s"])
        # A process of the tree that exited takes its ticks with it: never count that as
        # negative use (it would make other work look larger).
        own = max(0.0, float(b["server_s"]) - float(a["server_s"])) + \
            max(0.0, float(b["client_s"]) - float(a["client_s"]))
        t0.append(float(a["t"]))
        t1.append(float(b["t"]))
        f.append(min(1.0, max(0.0, (busy - own) / cap)))
        g.append(_wait_share(a, b))
    return np.array(t0), np.array(t1), np.array(f), np.array(g)


def _wait_share(a: dict[str, Any], b: dict[str, Any]) -> float:
    try:
        ran = float(b["server_run_s"]) - float(a["server_run_s"])
        waited = float(b["server_wait_s"]) - float(a["server_wait_s"])
    except (KeyError, TypeError, ValueError):
        return float("nan")
    if ran < 0 or waited < 0 or ran + waited <= 0:  # a thread exited: its time left the sum
        return float("nan")
    return waited / (ran + waited)


def lost_share(f: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Per window, the share of a latency lost to other work (the module docstring): none in
    a quiet window (others took less than ``MIN_OTHER``: a host's daemons, whose percent of a
    long wait would otherwise read as a part of it); else the others' share f of the host, or
    where the server's threads' wait share g is known, g above the run's own quiet level when
    that is larger (a server whose threads spin keeps its CPU time: f understates its loss)."""
    quiet = (f < MIN_OTHER) & ~np.isnan(g)
    base = float(np.median(g[quiet])) if quiet.any() else 0.0
    waited = np.nan_to_num(g - base, nan=0.0)
    return np.where(f >= MIN_OTHER, np.maximum(f, np.clip(waited, 0.0, 1.0)), 0.0)


def _complete(x: dict[str, Any]) -> bool:
    return all(isinstance(x.get(k), (int, float)) for k in
               ("t", "host_busy_s", "host_all_s", "server_s", "client_s"))


def mean_share(t0: np.ndarray, t1: np.ndarray, f: np.ndarray, a: np.ndarray, b: np.ndarray
               ) -> np.ndarray:
    """The time-weighted other share over each interval [a, b] (the window that holds a for
    a zero-length interval; 0 outside every window)."""
    out = np.zeros(len(a))
    if len(f) == 0:
        return out
    for i, (lo, hi) in enumerate(zip(a, b, strict=True)):
        if not (np.isfinite(lo) and np.isfinite(hi)):
            continue
        if hi <= lo:
            k = np.searchsorted(t1, lo, side="left")
            out[i] = f[k] if k < len(f) and t0[k] <= lo else 0.0
            continue
        overlap = np.clip(np.minimum(t1, hi) - np.maximum(t0, lo), 0.0, None)
        out[i] = float((overlap * f).sum() / (hi - lo))
    return out


def intervals(s: Samples, run: RunData) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's own time interval (wall clock), by metric."""
    v = s.values
    if s.metric == "itl":
        return s.t - v, s.t
    if s.metric == "tpot":
        ttft = np.array([run.requests[int(i)].ttft_s or np.nan for i in s.req], dtype=float)
        e2el = np.array([run.requests[int(i)].e2el_s or np.nan for i in s.req], dtype=float)
        return s.t + ttft, s.t + e2el
    return s.t, s.t + v


def carve_contention(samples: dict[str, Samples], run: RunData) -> bool:
    """Add each sample's ``cpu_contention`` part (the module docstring), taken first out of its
    ``TAKES_FROM`` parts; False (nothing added) without host samples."""
    t0, t1, f, g = host_windows(run.host_cpu_samples)
    if len(f) == 0:
        return False
    share = lost_share(f, g)
    busy = (f >= MIN_OTHER).astype(float)
    for s in samples.values():
        if len(s.values) == 0:
            continue
        a, b = intervals(s, run)
        lost = np.nan_to_num(s.values * mean_share(t0, t1, share, a, b))
        # The counterfactual, where the run has enough quiet samples to say what a sample
        # costs without the other work: a sample's excess over the quiet ones' median, for
        # the part of its interval that was contended.
        contended = mean_share(t0, t1, busy, a, b)
        quiet = (contended == 0) & ~np.isnan(s.values)
        if quiet.sum() >= MIN_QUIET_SAMPLES:
            over = np.maximum(np.nan_to_num(s.values) - float(np.median(s.values[quiet])), 0.0)
            lost = np.maximum(lost, contended * over)
        left = lost
        for cause in TAKES_FROM:
            part = s.parts.get(cause)
            if part is not None:
                part = np.nan_to_num(part)
                s.parts[cause] = np.maximum(part - left, 0.0)
                left = np.maximum(left - part, 0.0)
        s.parts[CAUSE] = lost
    return True


def evidence(run: RunData, tail_t0: np.ndarray, tail_t1: np.ndarray) -> dict[str, Any]:
    """The figures behind a ``cpu_contention`` share: how much of the host other work took,
    over the run and over the tail samples' intervals."""
    t0, t1, f, g = host_windows(run.host_cpu_samples)
    if len(f) == 0:
        return {}
    ncpu = max(int(x.get("ncpu") or 1) for x in run.host_cpu_samples)
    tail = mean_share(t0, t1, f, tail_t0, tail_t1)
    w = t1 - t0
    ev: dict[str, Any] = {}
    if not np.isnan(g).all() and len(tail_t0):
        ev["server_wait_share_tail"] = round(float(mean_share(
            t0, t1, np.nan_to_num(g), tail_t0, tail_t1).mean()), 4)
    return ev | {"host_cores": ncpu,
            "other_cores_run_mean": round(float((f * w).sum() / w.sum()) * ncpu, 2),
            "other_cores_tail_mean": round(float(tail.mean()) * ncpu, 2) if len(tail) else 0.0,
            "other_cores_max": round(float(f.max()) * ncpu, 2),
            "other_cores_max_at_s": round(float(t0[int(f.argmax())] - (run.start_time or 0.0)),
                                          1)}
