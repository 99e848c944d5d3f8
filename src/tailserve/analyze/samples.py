"""Latency samples per metric, each with the raw seconds every cause could account for.

A sample is one request (TTFT, TPOT, E2EL) or one gap between streamed chunks (ITL). Its
``parts`` are what each cause contributed to it, *before* comparing with the typical sample:
attribution (attribution.py) subtracts each part's median, so a cost every request pays (the
network's millisecond, the prefill steps every decode shares) is not blamed for the tail.

With the server's timing (tailserve), the split is measured: queue, own prefill, preempted
time, the steps in the request's windows (their prefill part and stalls, from the step model),
client-minus-server. Without it (another server) only what the client sees can be judged:
own_prefill (TTFT against prompt length), queueing (TTFT against requests waiting for a first
token at send time) and prefill_interference (gaps that contain other requests' first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tailserve.analyze.data import Req, RunData
from tailserve.analyze.stepmodel import StepModel, WindowSums, nonneg_lstsq

# Step records and the server's first-token/finish stamps come from different processes;
# this much slack keeps a request's last step inside its window.
SLACK_S = 1e-3
SERVER_CAUSES = ("queueing", "prefill_interference", "own_prefill", "preemption",
                 "kv_cache_pressure", "engine_stall", "client_or_network", "cpu_contention")
CLIENT_CAUSES = ("queueing", "own_prefill", "prefill_interference")


@dataclass
class Samples:
    metric: str
    values: np.ndarray  # seconds
    t: np.ndarray  # wall time each sample happened (request send, or chunk arrival)
    req: np.ndarray  # index into RunData.requests
    parts: dict[str, np.ndarray] = field(default_factory=dict)


def _arr(xs: list[float | None]) -> np.ndarray:
    return np.array([np.nan if x is None else float(x) for x in xs], dtype=float)


def server_samples(run: RunData, model: StepModel | None,
                   ws: WindowSums | None) -> dict[str, Samples]:
    idx = [i for i, q in enumerate(run.requests)
           if q.ok and q.timing and q.ttft_s is not None and q.arrival_t is not None]
    qs = [run.requests[i] for i in idx]
    ri = np.array(idx, dtype=int)
    tm = [q.timing or {} for q in qs]

    def timing(key: str) -> np.ndarray:
        return _arr([d.get(key) or 0.0 for d in tm])

    queue, prefill, preempted = timing("queue_s"), timing("prefill_s"), timing("preempted_s")
    srv_ttft, srv_e2e, srv_decode = timing("ttft_s"), timing("e2e_s"), timing("decode_s")
    own_tokens = np.array([max(0, int(d.get("prompt_tokens") or 0)
                               - int(d.get("cached_prompt_tokens") or 0)) for d in tm], float)
    arr = _arr([q.arrival_t for q in qs])
    first = _arr([q.first_token_t for q in qs]) + SLACK_S
    fin = _arr([q.finished_t for q in qs]) + SLACK_S
    sched = arr + queue
    ttft, e2el = _arr([q.ttft_s for q in qs]), _arr([q.e2el_s for q in qs])
    send = _arr([q.send_t for q in qs])
    zero = np.zeros(len(qs))

    def win(name: str, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
        return ws(name, t0, t1) if ws is not None else zero

    waited = np.maximum(win("step_s", arr, sched), 1e-12)
    kv_frac = np.clip(win("kv_blocked_s", arr, sched) / waited, 0.0, 1.0)
    pre_frac = np.clip(win("preempt_blocked_s", arr, sched) / waited, 0.0, 1.0 - kv_frac)
    # Head-of-line: a request that arrives while another's long prompt is being prefilled
    # waits for that step to end although nothing holds it back; that wait is interference.
    hol_frac = np.clip(win("prefill_unblocked_s", arr, sched) / waited, 0.0,
                       1.0 - kv_frac - pre_frac)
    # Preempted time before the first token: what TTFT holds beyond queue and own prefill.
    pre_ttft = np.minimum(preempted, np.maximum(0.0, srv_ttft - queue - prefill))
    own = np.minimum(model.prefill_cost(own_tokens), prefill) if model is not None else prefill
    common = {
        "queueing": queue * (1.0 - kv_frac - pre_frac - hol_frac),
        "kv_cache_pressure": queue * kv_frac,
        "own_prefill": own,
    }
    out: dict[str, Samples] = {}
    out["ttft"] = Samples("ttft", ttft, send, ri, {
        **common,
        "preemption": queue * pre_frac + pre_ttft,
        "prefill_interference": queue * hol_frac
        + np.maximum(0.0, win("prefill_s", sched, first) - own),
        "engine_stall": win("stall_s", arr, first),
        "client_or_network": ttft - srv_ttft,
    })
    out["e2el"] = Samples("e2el", e2el, send, ri, {
        **common,
        "preemption": queue * pre_frac + preempted,
        "prefill_interference": queue * hol_frac
        + np.maximum(0.0, win("prefill_s", sched, fin) - own),
        "engine_stall": win("stall_s", arr, fin),
        "client_or_network": e2el - srv_e2e,
    })
    n_out = np.array([q.output_tokens for q in qs], dtype=float)
    ok = n_out >= 2
    per = 1.0 / np.maximum(n_out - 1.0, 1.0)
    out["tpot"] = Samples("tpot", ((e2el - ttft) * per)[ok], send[ok], ri[ok], {
        k: (v * per)[ok] for k, v in {
            "preemption": preempted - pre_ttft,
            "prefill_interference": win("prefill_s", first, fin),
            "engine_stall": win("stall_s", first, fin),
            "client_or_network": (e2el - ttft) - srv_decode,
        }.items()})
    out["itl"] = _server_itl(run, qs, ri, preempted, ws, run.delay_s)
    return out


def _gaps(run: RunData, qs: list[Req], ri: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every ITL gap: (value, chunk arrival wall time, position in qs, request index)."""
    vals, ends, pos = [], [], []
    for k, q in enumerate(qs):
        if not q.itl_s or q.send_t is None or q.ttft_s is None:
            continue
        g = np.asarray(q.itl_s, dtype=float)
        vals.append(g)
        ends.append(q.send_t + q.ttft_s + np.cumsum(g))
        pos.append(np.full(len(g), k))
    if not vals:
        e = np.zeros(0)
        return e, e, np.zeros(0, dtype=int), np.zeros(0, dtype=int)
    p = np.concatenate(pos).astype(int)
    return np.concatenate(vals), np.concatenate(ends), p, ri[p]


def _server_itl(run: RunData, qs: list[Req], ri: np.ndarray, preempted: np.ndarray,
                ws: WindowSums | None, delay: float) -> Samples:
    vals, ends, pos, req = _gaps(run, qs, ri)
    # The chunk left the server one delay before it arrived: the gap's steps are those that
    # ended between the two chunks' departures.
    t1 = ends - delay + SLACK_S
    t0 = t1 - vals
    zero = np.zeros(len(vals))
    steps = ws("step_s", t0, t1) if ws is not None else vals
    # Preempted time shows up as the request's longest gaps: charge it to them, longest first.
    pre = zero.copy()
    for k in np.flatnonzero(preempted > 0):
        mine = np.flatnonzero(pos == k)
        left = float(preempted[k])
        for j in mine[np.argsort(-vals[mine])]:
            if left <= 0:
                break
            pre[j] = min(left, vals[j])
            left -= pre[j]
    return Samples("itl", vals, ends, req, {
        "prefill_interference": ws("prefill_s", t0, t1) if ws is not None else zero,
        "engine_stall": ws("stall_s", t0, t1) if ws is not None else zero,
        "preemption": pre,
        # A gap with no step ending inside it is a hole in the timeline (the server's ring
        # dropped records), not a gap the client made: no part for it.
        "client_or_network": np.where(steps > 0, np.maximum(0.0, vals - steps), 0.0)
        if ws is not None else zero,
    })


# Sends this close are one burst: the server sees them in whatever order its sockets give.
SAME_SEND_S = 2e-3


def queue_ahead(send: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Per request, the queue ahead of it: requests sent no later than it (within
    ``SAME_SEND_S``) that were still waiting when it was sent and got their first token
    before it did. With distinct send times that is the requests it found waiting, served
    first (FCFS); in a burst sent all at once, where the server's arrival order is not the
    client's, it is how many of the burst were served before it."""
    out = np.zeros(len(send))
    for i0 in range(0, len(send), 512):  # 512 x n booleans at a time
        s, f = send[i0:i0 + 512, None], first[i0:i0 + 512, None]
        ahead = (send[None, :] <= s + SAME_SEND_S) & (first[None, :] > s) & (first[None, :] < f)
        out[i0:i0 + 512] = ahead.sum(axis=1)
    return out


def client_samples(run: RunData) -> dict[str, Samples]:
    """Another server: what the client's own clock supports, by regression."""
    idx = [i for i, q in enumerate(run.requests) if q.ok and q.ttft_s is not None]
    qs = [run.requests[i] for i in idx]
    ri = np.array(idx, dtype=int)
    ttft = _arr([q.ttft_s for q in qs])
    plen = np.array([q.prompt_len for q in qs], dtype=float)
    send = _arr([q.send_t for q in qs])
    timed = bool(len(qs)) and not np.isnan(send).any()
    first = send + ttft if timed else np.full(len(qs), np.nan)
    ahead = queue_ahead(send, first) if timed else np.zeros(len(qs))
    x = np.column_stack([np.ones_like(plen), plen, plen * plen / 1000.0, ahead])
    coef = nonneg_lstsq(x, ttft) if len(qs) > x.shape[1] else np.zeros(4)
    own = coef[1] * plen + coef[2] * plen * plen / 1000.0
    queue = coef[3] * ahead
    out = {"ttft": Samples("ttft", ttft, send, ri, {"own_prefill": own, "queueing": queue})}
    vals, ends, pos, req = _gaps(run, qs, ri)
    interf = np.zeros(len(vals))
    if timed and len(vals) > 3:
        # A gap holding other requests' first tokens held their prefill: fit the gap against
        # the prompt tokens that finished prefill inside it.
        o = np.argsort(first)
        cum = np.concatenate([[0.0], np.cumsum(plen[o])])
        cum2 = np.concatenate([[0.0], np.cumsum(plen[o] ** 2 / 1000.0)])
        # A first token from the step that ended this gap arrives with the gap's own chunk,
        # in either order: shift the window by the slack so it lands inside.
        i0 = np.searchsorted(first[o], ends - vals + SLACK_S, side="right")
        i1 = np.searchsorted(first[o], ends + SLACK_S, side="right")
        p1, p2 = cum[i1] - cum[i0], cum2[i1] - cum2[i0]
        c = nonneg_lstsq(np.column_stack([np.ones_like(vals), p1, p2]), vals)
        interf = c[1] * p1 + c[2] * p2
    out["itl"] = Samples("itl", vals, ends, req, {"prefill_interference": interf})
    per_req = np.bincount(pos, weights=interf, minlength=len(qs)) if len(vals) else \
        np.zeros(len(qs))
    e2el = _arr([q.e2el_s for q in qs])
    n_out = np.array([q.output_tokens for q in qs], dtype=float)
    ok = (n_out >= 2) & ~np.isnan(e2el)
    out["e2el"] = Samples("e2el", e2el[~np.isnan(e2el)], send[~np.isnan(e2el)],
                          ri[~np.isnan(e2el)], {
                              "own_prefill": own[~np.isnan(e2el)],
                              "queueing": queue[~np.isnan(e2el)],
                              "prefill_interference": per_req[~np.isnan(e2el)]})
    per = 1.0 / np.maximum(n_out - 1.0, 1.0)
    out["tpot"] = Samples("tpot", ((e2el - ttft) * per)[ok], send[ok], ri[ok],
                          {"prefill_interference": (per_req * per)[ok]})
    return out
