"""``tailserve diagnose`` on a run through a router (``tailserve bench --replica URL ...``).

The result carries one observation per replica (its ``/metrics`` samples, ``/health`` and
timeline) and each request's replica (bench/replicas.py). Each replica is analyzed as a server
of its own — its steps, its step model, its requests' parts (samples.py) — and the samples are
joined, so the tail is the run's tail, and two causes only a router's run can have are named:

- ``slow_replica``: a replica whose steps are slower for the same batch than its peers'. Its
  steps are set against a step model fitted on the *other* replicas' steps (stepmodel.py, the
  engine's features), leaving itself out; the median ratio of actual to predicted is its
  ``slowness``. At ``SLOW_FACTOR`` or more, ``1 - 1/slowness`` of each of its samples' server
  time is the slowness's, moved from the other server-side parts (queueing included: a slow
  replica also drains its queue slowly).
- ``router_imbalance``: a request that queued on its replica (others waiting ahead of it)
  while another healthy replica had no queue waited because of where the router sent it. Its
  queueing part, times the share of its wait during which that held, is moved to
  ``router_imbalance``. Not on a slow replica: its queue is the slowness's.

Either is reassignment, not addition: the parts still sum to what the sample cost, and the
attribution (attribution.py) is the one every run gets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.attribution import CauseShare, MetricTail, attribute, time_ranges
from tailserve.analyze.data import RunData, Steps, run_from_result
from tailserve.analyze.samples import SERVER_CAUSES, Samples, server_samples
from tailserve.analyze.stepmodel import StepModel, WindowSums, fit_step_model
from tailserve.bench.replicas import attribute_requests
from tailserve.stepcost import features

REPLICA_CAUSES = ("router_imbalance", "slow_replica")
MIN_STEPS = 8  # as diagnose.MIN_STEPS_FOR_FIT: fewer steps fit no model
SLOW_FACTOR = 1.5  # steps this much slower than the peers' model predicts: a slow replica
QUEUE_PROBES = 16  # points of a request's wait checked against the other replicas' queues


@dataclass
class ReplicaRun:
    index: int
    url: str
    run: RunData  # this replica's requests (joined with its timeline) and its steps
    req_index: np.ndarray  # position of run.requests[k] in the joined run's requests
    healthy: bool  # every /health sample over the run answered 200
    health_failures: int = 0
    model: StepModel | None = None
    slowness: float | None = None  # step time over the peers' model for the same batches
    breakdown: dict[str, Any] = field(default_factory=dict)


def joined_run(result: dict[str, Any],
               extra_timeline: list[dict[str, Any]] | None = None) -> RunData:
    """The run as a whole (all requests, every replica's steps on one axis) with
    ``replicas`` holding each replica's own view."""
    ts = result["tailserve"]
    observed = [o for o in ts["replicas"] if isinstance(o, dict)]
    records = list(ts.get("requests") or [])
    if records and all("replica" in r for r in records):
        where = [r.get("replica") for r in records]
    else:  # an older or hand-made file: the bench's rule, from the timelines
        where = attribute_requests([str(r.get("request_id")) for r in records],
                                   [o.get("timeline") for o in observed]).replica

    def sub(mine: list[int], server: dict[str, Any]) -> RunData:
        ts_i = {k: v for k, v in ts.items() if k not in ("replicas", "server")}
        ts_i["requests"] = [records[k] for k in mine]
        ts_i["server"] = server
        return run_from_result({**result, "tailserve": ts_i})

    everything = [r for o in observed for r in o.get("timeline") or []]
    joined = sub(list(range(len(records))),
                 {"timeline": everything + list(extra_timeline or []), "metric_samples": []})
    reps = []
    for i, o in enumerate(observed):
        mine = [k for k, w in enumerate(where) if w == i]
        run_i = sub(mine, {"timeline": o.get("timeline") or [],
                           "metric_samples": o.get("metric_samples") or []})
        for k, q in zip(mine, run_i.requests, strict=True):
            joined.requests[k] = q  # the request as its own replica's timeline sees it
        bad = sum(h.get("status") != 200 for h in o.get("health") or [])
        reps.append(ReplicaRun(i, str(o.get("url", f"replica {i}")), run_i,
                               np.array(mine, dtype=int), healthy=bad == 0,
                               health_failures=bad))
    joined.replicas = reps
    joined.has_timing = any(q.timing for q in joined.requests)
    unmatched = sum(w is None for w in where)
    if unmatched:
        joined.notes.append(f"{unmatched} of {len(records)} requests were found on no "
                            "replica's timeline; they are in the totals, not per replica")
    return joined


def concat_steps(parts: list[Steps]) -> Steps:
    """Several replicas' steps as one ``Steps``, ordered by time."""
    t = np.concatenate([s.t for s in parts])
    order = np.argsort(t, kind="stable")
    cols: dict[str, Any] = {}
    for f in dataclasses.fields(Steps):
        vals = [getattr(s, f.name) for s in parts]
        if isinstance(vals[0], np.ndarray):
            cols[f.name] = np.concatenate(vals)[order]
        else:
            flat = [x for v in vals for x in v]
            cols[f.name] = [flat[k] for k in order]
    return Steps(**cols)


def predict(model: StepModel, steps: Steps) -> np.ndarray:
    """Seconds ``model`` gives each of ``steps``' batches (stepmodel's design, any steps)."""
    p = steps.prefill
    x = np.column_stack([np.ones_like(p), *features(p, steps.decode, steps.context,
                                                    steps.pairs)[1:]])
    return np.asarray(x @ model.coef)


def slowness(reps: list[ReplicaRun]) -> dict[int, float]:
    """Each replica's median step time over what its peers' step model predicts for the
    same batches (its own stalls left out)."""
    fitted = [r for r in reps if r.run.steps is not None and len(r.run.steps) >= MIN_STEPS]
    out: dict[int, float] = {}
    for r in fitted:
        peers = [p.run.steps for p in fitted if p is not r and p.run.steps is not None]
        if not peers:
            continue
        pooled = concat_steps(peers)
        peer_model = fit_step_model(pooled)
        st = r.run.steps
        assert st is not None
        pred = np.maximum(predict(peer_model, st), 1e-6)
        keep = r.model.stall == 0 if r.model is not None else np.ones(len(pred), dtype=bool)
        # Only batches the peers ran too (decode count and prefill size within their range):
        # a model extrapolated to batches it never saw says nothing about the host.
        keep &= (st.decode >= pooled.decode.min()) & (st.decode <= pooled.decode.max())
        keep &= st.prefill <= pooled.prefill.max()
        if keep.sum() >= MIN_STEPS:
            out[r.index] = float(np.median(st.step_s[keep] / pred[keep]))
    return out


def queued_at(steps: Steps | None, t: np.ndarray) -> np.ndarray:
    """Whether the replica had requests waiting at each time: inside a step (from the one
    before it to its end) that recorded a waiting request. No steps: idle, no queue."""
    if steps is None or not len(steps):
        return np.zeros(len(t), dtype=bool)
    k = np.searchsorted(steps.t, t, side="left")
    inside = (k < len(steps)) & (k > 0)
    kk = np.clip(k, 0, len(steps) - 1)
    return inside & (steps.waiting[kk] > 0)


def free_elsewhere(reps: list[ReplicaRun], mine: int, t0: np.ndarray,
                   t1: np.ndarray) -> np.ndarray:
    """Per window [t0, t1]: the share of it during which replica ``mine`` had a queue and
    some other healthy replica had none (``QUEUE_PROBES`` points). A wait with no queue on
    its own replica is the wait for the running step to end, which every replica has."""
    others = [r for r in reps if r.index != mine and r.healthy]
    if not others or not len(t0):
        return np.zeros(len(t0))
    frac = (np.arange(QUEUE_PROBES) + 0.5) / QUEUE_PROBES
    probes = t0[:, None] + (t1 - t0)[:, None] * frac[None, :]
    flat = probes.ravel()
    all_queued = np.ones(len(flat), dtype=bool)
    for r in others:
        all_queued &= queued_at(r.run.steps, flat)
    own = queued_at(next(r for r in reps if r.index == mine).run.steps, flat)
    return np.asarray((own & ~all_queued).reshape(probes.shape).mean(axis=1))


def merged_samples(run: RunData, reps: list[ReplicaRun]) -> tuple[dict[str, Samples],
                                                                  dict[str, np.ndarray]]:
    """Every replica's samples on the joined run's request indices, with the two replica
    parts; and per metric the replica of each sample."""
    slow = {r.index: r.slowness for r in reps
            if r.slowness is not None and r.slowness >= SLOW_FACTOR}
    per: dict[str, list[tuple[int, Samples]]] = {}
    for r in reps:
        if not r.run.has_timing or not r.run.requests:
            continue
        ws = WindowSums(r.run.steps, r.model) if r.run.steps is not None else None
        for m, s in server_samples(r.run, r.model, ws).items():
            s.req = r.req_index[s.req] if len(s.req) else s.req.astype(int)
            reassign(s, run, reps, r.index, slow.get(r.index))
            per.setdefault(m, []).append((r.index, s))
    out, owner = {}, {}
    for m, items in per.items():
        names = sorted({c for _, s in items for c in s.parts}, key=_cause_order)
        out[m] = Samples(m, np.concatenate([s.values for _, s in items]),
                         np.concatenate([s.t for _, s in items]),
                         np.concatenate([s.req for _, s in items]).astype(int),
                         {c: np.concatenate([s.parts.get(c, np.zeros(len(s.values)))
                                             for _, s in items]) for c in names})
        owner[m] = np.concatenate([np.full(len(s.values), i) for i, s in items])
    return out, owner


def _cause_order(c: str) -> int:
    order = (*SERVER_CAUSES, *REPLICA_CAUSES)
    return order.index(c) if c in order else len(order)


def reassign(s: Samples, run: RunData, reps: list[ReplicaRun], mine: int,
             slow: float | None) -> None:
    """Move the replica causes' seconds out of the parts they hide in (in place)."""
    n = len(s.values)
    imb = np.zeros(n)
    # A slow replica's queue is its slowness's (it drains slowly), not the router's: the
    # router's part is judged on replicas of normal speed only.
    if "queueing" in s.parts and n and slow is None:
        reqs = [run.requests[int(k)] for k in s.req]
        arr = np.array([q.arrival_t or 0.0 for q in reqs], dtype=float)
        wait = np.array([float((q.timing or {}).get("queue_s") or 0.0) for q in reqs])
        share = free_elsewhere(reps, mine, arr, arr + wait)
        imb = s.parts["queueing"] * share
        s.parts["queueing"] = s.parts["queueing"] - imb
    s.parts["router_imbalance"] = imb
    part = np.zeros(n)
    if slow is not None and n:
        client = np.nan_to_num(s.parts.get("client_or_network", np.zeros(n)))
        server_s = np.maximum(np.nan_to_num(s.values) - np.maximum(client, 0.0), 0.0)
        part = server_s * (1.0 - 1.0 / slow)
        for c in list(s.parts):
            if c not in ("client_or_network", "router_imbalance"):
                s.parts[c] = s.parts[c] / slow
    s.parts["slow_replica"] = part


def _pct_ms(x: list[float] | np.ndarray, p: float) -> float | None:
    a = np.asarray(x, dtype=float)
    a = a[~np.isnan(a)]
    return round(float(np.percentile(a, p)) * 1e3, 3) if len(a) else None


def breakdown(r: ReplicaRun, total: int, duration_s: float) -> dict[str, Any]:
    qs = r.run.requests
    ok = [q for q in qs if q.ok]
    ttft = [q.ttft_s for q in ok if q.ttft_s is not None]
    itl = [g for q in ok for g in q.itl_s]
    queue = [float(q.timing.get("queue_s") or 0.0) for q in ok if q.timing]
    st = r.run.steps
    out: dict[str, Any] = {
        "index": r.index, "url": r.url, "num_requests": len(qs),
        "share_of_requests": round(len(qs) / total, 4) if total else 0.0,
        "failed": len(qs) - len(ok),
        "ttft_p50_ms": _pct_ms(ttft, 50), "ttft_p99_ms": _pct_ms(ttft, 99),
        "itl_p50_ms": _pct_ms(itl, 50), "itl_p99_ms": _pct_ms(itl, 99),
        "queue_p50_ms": _pct_ms(queue, 50), "queue_p99_ms": _pct_ms(queue, 99),
        "num_steps": len(st) if st is not None else 0,
        "step_p50_ms": _pct_ms(st.step_s, 50) if st is not None else None,
        "step_p99_ms": _pct_ms(st.step_s, 99) if st is not None else None,
        "max_waiting": int(st.waiting.max()) if st is not None and len(st) else 0,
        # share of the run's wall time the replica spent inside steps
        "busy_share": round(float(st.step_s.sum()) / duration_s, 4)
        if st is not None and duration_s > 0 else 0.0,
        "slowness": None if r.slowness is None else round(r.slowness, 3),
        "healthy": r.healthy, "health_failures": r.health_failures,
    }
    return out


def explain_replica_cause(c: CauseShare, mt: MetricTail, s: Samples, owner: np.ndarray,
                          run: RunData, reps: list[ReplicaRun]) -> None:
    """Evidence and advice for ``slow_replica`` / ``router_imbalance`` (in place)."""
    hit = c.seconds > 0
    tail_owner = owner[mt.tail]
    culprit = int(np.bincount(tail_owner[hit], weights=c.seconds[hit],
                              minlength=len(reps)).argmax()) if hit.any() else 0
    rep = reps[culprit]
    ev: dict[str, Any] = {
        "replica": rep.url, "tail_samples_affected": int(hit.sum()),
        "tail_samples": len(mt.tail),
        "mean_ms_per_affected_sample": round(float(c.seconds[hit].mean()) * 1e3, 3)
        if hit.any() else 0.0,
        "tail_share_from_replica": round(float(np.mean(tail_owner == culprit)), 4),
        "sample_share_from_replica": round(float(np.mean(owner == culprit)), 4),
        "windows_s": time_ranges(s.t[mt.tail][hit], run.start_time or 0.0) if hit.any()
        else [],
    }
    if c.cause == "slow_replica":
        peers = [r.breakdown.get("step_p50_ms") for r in reps if r is not rep]
        ev |= {"slowness": round(rep.slowness or 0.0, 3),
               "median_step_ms": rep.breakdown.get("step_p50_ms"),
               "peers_median_step_ms": [p for p in peers if p is not None]}
        c.advice = (f"replica {rep.url} runs the same batches {rep.slowness or 0:.1f}x slower "
                    "than its peers' step model predicts, and its requests make the tail: "
                    "check that host (CPU model and frequency, --threads / OMP_NUM_THREADS, "
                    "other processes on it, a different build or engine flags); take it out "
                    "of the router's worker list until it matches the others.")
    else:
        ev |= {"requests_per_replica": [len(r.run.requests) for r in reps],
               "max_waiting_per_replica": [r.breakdown.get("max_waiting") for r in reps],
               "busy_share_per_replica": [r.breakdown.get("busy_share") for r in reps]}
        idle = [r.url for r in reps if r is not rep and r.healthy]
        c.advice = (f"requests queued on {rep.url} while {', '.join(idle) or 'another'} had "
                    "no queue: the router's choice, not capacity. Check its policy "
                    "(cache_aware sends a shared prefix to one replica until vllm-router's "
                    "--balance-abs-threshold / --balance-rel-threshold say the load is "
                    "uneven; round_robin or power_of_two spread it), that every replica is in "
                    "its --worker-urls and healthy, and that clients go through the router.")
    c.evidence = ev


def judge(run: RunData, percentile: float) -> tuple[dict[str, Samples], dict[str, MetricTail],
                                                   StepModel | None, list[str]]:
    """Fit, sample and attribute a joined run; the causes of the replica parts explained."""
    from tailserve.analyze.advice import explain

    reps: list[ReplicaRun] = run.replicas or []
    for r in reps:
        st = r.run.steps
        r.model = fit_step_model(st) if st is not None and len(st) >= MIN_STEPS else None
    for i, x in slowness(reps).items():
        reps[i].slowness = x
    total = len(run.requests)
    for r in reps:
        r.breakdown = breakdown(r, total, run.duration_s)
    samples, owner = merged_samples(run, reps)
    pooled = fit_step_model(run.steps) if run.steps is not None and \
        len(run.steps) >= MIN_STEPS else None
    cannot = [c for c in SERVER_CAUSES
              if c != "client_or_network" and any(r.run.steps is None for r in reps
                                                  if r.run.requests)]
    tails: dict[str, MetricTail] = {}
    for m in ("ttft", "tpot", "itl", "e2el"):
        s = samples.get(m)
        if s is None or not len(s.values):
            continue
        mt = attribute(s, percentile, cannot)
        if mt is None:
            continue
        for cs in mt.causes:
            if cs.cause in REPLICA_CAUSES:
                explain_replica_cause(cs, mt, s, owner[m], run, reps)
            else:
                explain(cs, mt, s, run, pooled)
        tails[m] = mt
    return samples, tails, pooled, cannot


def findings(run: RunData, tails: dict[str, MetricTail]) -> list[str]:
    """Sentences on the replicas, after diagnose's own."""
    reps: list[ReplicaRun] = run.replicas or []
    parts = ", ".join(f"{r.url} {len(r.run.requests)}" for r in reps)
    out = [f"Requests per replica: {parts} (of {len(run.requests)})."]
    named: dict[str, tuple[str, CauseShare]] = {}
    for m, t in tails.items():
        for c in t.causes:
            if c.cause in REPLICA_CAUSES and (c.cause not in named
                                               or c.share > named[c.cause][1].share):
                named[c.cause] = (m, c)
    for cause, (m, c) in sorted(named.items()):
        ev = c.evidence
        what = (f"its steps {ev.get('slowness')}x what its peers' step model predicts"
                if cause == "slow_replica" else
                f"requests per replica {ev.get('requests_per_replica')}")
        out.append(f"{cause}: {ev.get('replica')} ({what}) is {c.share:.0%} of the "
                   f"{m.upper()} tail; {ev.get('tail_share_from_replica', 0):.0%} of the "
                   f"tail samples came from it, {ev.get('sample_share_from_replica', 0):.0%} "
                   "of all.")
    return out
