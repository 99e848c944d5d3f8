"""A tiny discrete-event engine that writes bench results with planted tail causes.

It schedules like tailserve with chunked prefill off (FCFS, whole prompts in one step, decodes
every step, KV blocks reserved for prompt + output at admission) and prices each step as
``base + per_decode·decode_seqs + per_prefill·prefill_tokens``, plus whatever the scenario
plants (stalls, preemptions). The output has the exact shape ``tailserve bench
--save-result`` writes: vLLM's keys, the ``tailserve`` block with per-request records, the
server's timing, and the step and request timeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

T0 = 1_780_000_000.0  # wall clock of the run's start
NET_S = 0.0005  # server -> client delay of every chunk
BLOCK = 16


@dataclass
class Sim:
    n: int = 200
    rate: float = 10.0
    prompt: Callable[[int, np.random.Generator], int] = lambda i, rng: 64
    output: int = 24
    base_s: float = 0.010
    per_decode_s: float = 0.0004
    per_prefill_s: float = 0.00002
    max_num_seqs: int = 16
    total_blocks: int = 100_000
    noise: float = 0.03  # relative step-time noise
    stall: Callable[[int, float, np.random.Generator], float] = lambda k, t, rng: 0.0
    # (from_s, to_s, hold_s): inside the window one running request per step is preempted
    # and may not come back for hold_s
    preempt: tuple[float, float, float] | None = None
    seed: int = 0


@dataclass
class _R:
    i: int
    arrival: float
    prompt: int
    out: int
    first_sched: float | None = None
    prefill_s: float = 0.0
    tokens: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    preempted_s: float = 0.0
    hold_until: float = 0.0
    blocks: int = 0
    needs_prefill: bool = True


def simulate(sim: Sim) -> dict[str, Any]:
    rng = np.random.default_rng(sim.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / sim.rate, sim.n))
    reqs = [_R(i, T0 + float(a), sim.prompt(i, rng), sim.output) for i, a in enumerate(arrivals)]
    pending = list(reqs)
    waiting: list[_R] = []
    running: list[_R] = []
    free = sim.total_blocks
    t = reqs[0].arrival
    k = 0
    steps: list[dict[str, Any]] = []
    done: list[_R] = []
    while len(done) < sim.n:
        while pending and pending[0].arrival <= t:
            waiting.append(pending.pop(0))
        if not running and not any(r.hold_until <= t for r in waiting):
            nxt = [pending[0].arrival] if pending else []
            nxt += [r.hold_until for r in waiting]
            t = max(t, min(nxt))
            continue
        n_pre = 0
        if sim.preempt and sim.preempt[0] <= t - T0 < sim.preempt[1] and len(running) > 1:
            victim = running.pop()
            free += victim.blocks
            victim.blocks, victim.needs_prefill = 0, True
            victim.num_preemptions += 1
            victim.hold_until = t + sim.preempt[2]
            victim.preempted_s += sim.preempt[2]
            waiting.insert(0, victim)
            n_pre = 1
        blocked = "preemption" if n_pre and waiting else None
        admitted: list[_R] = []
        if not n_pre and waiting and waiting[0].hold_until > t:
            blocked = "preemption"  # a preempted request at the head waits to recompute
        while not n_pre and waiting and waiting[0].hold_until <= t:
            if len(running) >= sim.max_num_seqs:
                blocked = "max_num_seqs"
                break
            r = waiting[0]
            need = math.ceil((r.prompt + r.out) / BLOCK)
            if need > free:
                blocked = "kv_cache"
                break
            waiting.pop(0)
            free -= need
            r.blocks = need
            running.append(r)
            admitted.append(r)
            if r.first_sched is None:
                r.first_sched = t
        prefill = [r for r in running if r.needs_prefill]
        decode = [r for r in running if not r.needs_prefill]
        p_tok = sum(r.prompt + len(r.tokens) for r in prefill)
        step_s = (sim.base_s + sim.per_decode_s * len(decode) + sim.per_prefill_s * p_tok)
        step_s *= 1.0 + sim.noise * float(rng.standard_normal())
        step_s = max(step_s, 1e-4) + sim.stall(k, t - T0, rng)
        t += step_s
        k += 1
        for r in prefill:
            if not r.tokens:
                r.prefill_s += step_s
            r.needs_prefill = False
        for r in running:
            r.tokens.append(t)
        for r in [r for r in running if len(r.tokens) >= r.out]:
            running.remove(r)
            free += r.blocks
            done.append(r)
        steps.append({"kind": "step", "t": t, "step_s": step_s, "num_prefill_tokens": p_tok,
                      "num_decode_seqs": len(decode), "num_scheduled_seqs": len(running),
                      "num_running": len(running), "num_waiting": len(waiting),
                      "free_blocks": free, "total_blocks": sim.total_blocks,
                      "num_preemptions": n_pre, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0, "num_finished": 0,
                      "admission_blocked_by": blocked,
                      "memory": {"rss_bytes": 1.0e9 + 1e6 * len(running)}})
    return _result(reqs, steps, t)


def _result(reqs: list[_R], steps: list[dict[str, Any]], t_end: float) -> dict[str, Any]:
    records, timeline = [], list(steps)
    for r in reqs:
        assert r.first_sched is not None
        srv_arrival = r.arrival + 0.0002
        client = [x + NET_S for x in r.tokens]
        timing = {"queue_s": r.first_sched - srv_arrival, "prefill_s": r.prefill_s,
                  "ttft_s": r.tokens[0] - srv_arrival, "decode_s": r.tokens[-1] - r.tokens[0],
                  "e2e_s": r.tokens[-1] - srv_arrival, "num_steps": len(r.tokens),
                  "num_steps_with_prefill": 0, "time_in_steps_with_prefill_s": 0.0,
                  "num_preemptions": r.num_preemptions, "preempted_s": r.preempted_s,
                  "prompt_tokens": r.prompt, "cached_prompt_tokens": 0,
                  "output_tokens": r.out}
        rid = f"bench-sim-0-{r.i}"
        records.append({
            "index": r.i, "request_id": rid, "prompt_len": r.prompt, "output_len": r.out,
            "scheduled_s": r.arrival - T0, "send_s": r.arrival - T0,
            "end_s": client[-1] - T0, "ttft_s": client[0] - r.arrival,
            "itl_s": list(np.diff(client)), "e2el_s": client[-1] - r.arrival,
            "output_tokens": r.out, "output_tokens_source": "usage",
            "server_prompt_tokens": r.prompt, "status": 200, "error_type": None,
            "error": None, "finish_reason": "length", "server_timing": timing, "lag_s": 0.0})
        timeline.append({"kind": "request", "t": r.tokens[-1], "request_id": rid,
                         "finish_reason": "length", "error_type": None,
                         "prompt_tokens": r.prompt, "output_tokens": r.out, "timing": timing,
                         "http_status": 200, "arrival_time": srv_arrival,
                         "first_token_time": r.tokens[0], "finished_time": r.tokens[-1]})
    timeline.sort(key=lambda x: x["t"])
    duration = t_end + NET_S - T0
    return {
        "date": "20260101-000000", "backend": "openai", "label": None, "model_id": "sim",
        "num_prompts": len(reqs), "request_rate": 10.0, "burstiness": 1.0,
        "max_concurrency": None, "duration": duration, "completed": len(reqs), "failed": 0,
        "tailserve": {
            "step": {"index": 0, "name": "sim", "run_id": "sim"}, "interrupted": False,
            "start_time": T0, "start_perf_counter": 0.0, "warnings": [],
            "requests": records,
            "server": {"metric_names": [], "metric_samples": [], "timeline": timeline},
        },
    }


def without_server(result: dict[str, Any]) -> dict[str, Any]:
    """The same run as a bench against another server sees it: no timing, no timeline."""
    ts = dict(result["tailserve"])
    ts.pop("server")
    ts["requests"] = [{**q, "server_timing": None} for q in ts["requests"]]
    return {**result, "tailserve": ts}
