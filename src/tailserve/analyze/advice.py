"""Evidence (numbers, time windows) and one sentence of advice per cause.

Evidence is what a person would check before believing the share: how many tail samples the
cause touched and by how much, when, and the run-wide figure behind it (the fitted cost of a
prefill token, the blocked steps, the worst stall). Advice names the knob, in the flags'
own spelling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.analyze.attribution import NONE_FACTOR, CauseShare, MetricTail, time_ranges
from tailserve.analyze.contention import evidence as contention_evidence
from tailserve.analyze.contention import intervals
from tailserve.analyze.counters import signal_evidence
from tailserve.analyze.data import BLOCKED_KV, RunData, Steps
from tailserve.analyze.evidence import sentences
from tailserve.analyze.samples import Samples
from tailserve.analyze.stepmodel import StepModel

# An ITL target more than this many times the decode-only step is too large to call steady.
TARGET_TOO_LARGE = 3.0


def _ms(x: float) -> float:
    return round(float(x) * 1e3, 3)


def _rel(run: RunData, t: float) -> float:
    return round(t - (run.start_time or 0.0), 2)


def load_rates(run: RunData) -> tuple[float, float]:
    """(offered, served) requests/s: sends over the send span, completions over the span
    from first send to last completion."""
    sends = sorted(q.send_t for q in run.requests if q.send_t is not None)
    ends = [q.send_t + q.e2el_s for q in run.requests
            if q.ok and q.send_t is not None and q.e2el_s is not None]
    if len(sends) < 2 or not ends:
        return 0.0, 0.0
    offered = (len(sends) - 1) / max(sends[-1] - sends[0], 1e-9)
    served = len(ends) / max(max(ends) - sends[0], 1e-9)
    return offered, served


def _interference_advice(steps: Steps | None, ev: dict[str, Any], metric: str) -> str:
    """Name the knob that sized the interfering steps: the ITL target when steps were sized
    by time (too large a target, or steps that overran it), the token budget otherwise; for
    a first token, the cap on steps without decodes (a prompt that arrives while another
    prefills waits for the step in flight)."""
    split = ("long prompts stall running decodes: enable chunked prefill "
             "(--enable-chunked-prefill) and/or lower --long-prefill-token-threshold or "
             "--max-num-batched-tokens so a prompt is split across steps")
    if steps is None or not len(steps) or np.all(np.isnan(steps.itl_target)):
        return split + ", or size steps by time (--slo-itl-ms)."
    alone = (steps.prefill > 0) & (steps.decode == 0)
    if metric == "ttft" and alone.any():
        med = float(np.median(steps.step_s[alone])) * 1e3
        top = float(np.max(steps.step_s[alone])) * 1e3
        ev |= {"median_prefill_only_step_ms": round(med, 3),
               "max_prefill_only_step_ms": round(top, 3)}
        advice = (f"a prompt that arrives while others prefill waits for the step in flight: "
                  f"steps without decodes took {med:.0f} ms at the median and up to {top:.0f} "
                  "ms; a lower --slo-itl-ms (it caps steps without decodes too) makes that "
                  "wait shorter, at a few more steps' fixed cost for long prompts.")
        return advice + _quiet_cap_note(steps, alone, ev)
    target = float(np.nanmedian(steps.itl_target))
    mixed = (steps.prefill > 0) & (steps.decode > 0)
    decode_only = (steps.prefill == 0) & (steps.decode > 0)
    if not mixed.any():
        return split + "."
    mixed_ms = float(np.median(steps.step_s[mixed])) * 1e3
    base_ms = float(np.median(steps.step_s[decode_only])) * 1e3 if decode_only.any() else 0.0
    ev |= {"itl_target_ms": _ms(target), "median_step_with_prefill_ms": round(mixed_ms, 3),
           "median_decode_only_step_ms": round(base_ms, 3)}
    if mixed_ms > 1.5 * target * 1e3:
        return (f"steps with prefill took {mixed_ms:.0f} ms at the median, over the ITL target "
                f"of {target * 1e3:.0f} ms: the step-time model under-predicted them (compare "
                "predicted_s with step_s in the timeline) or a prompt was not split "
                "(--enable-chunked-prefill); a lower --slo-itl-ms leaves more headroom.")
    if base_ms > 0 and target * 1e3 > TARGET_TOO_LARGE * base_ms:
        return (f"steps with prefill are sized to the ITL SLO (--slo-itl-ms "
                f"{target * 1e3:.0f}), {target * 1e3 / base_ms:.1f}x the decode-only step of "
                f"{base_ms:.0f} ms: that is too large for a steady ITL; a lower --slo-itl-ms "
                "makes prefill take more, smaller steps: TTFT rises.")
    return (f"prefill steps stay near the ITL target ({target * 1e3:.0f} ms), which the tail "
            "is made of: lower --slo-itl-ms to trade TTFT for a steadier ITL.")


def _quiet_cap_note(steps: Steps, alone: np.ndarray, ev: dict[str, Any]) -> str:
    """Where the cap on steps without decodes was the arrival watch's (the step in which
    ``step_time.ARRIVAL_RISK`` arrivals are expected, past the ITL SLO's cap; the cap in
    force after the step before), say so: the engine had seen few arrivals while it
    worked, and the first ones after such a stretch waited for a long step."""
    before = np.array([False] + [by == "arrivals" for by in steps.prefill_cap_by[:-1]])
    lifted = alone & before
    if not lifted.any():
        return ""
    rate = float(np.nanmedian(steps.arrival_rate[np.flatnonzero(lifted) - 1]))
    ev |= {"prefill_only_steps_past_the_itl_cap": int(lifted.sum()),
           "busy_arrival_rate_per_s": round(rate, 4)}
    return (f" {int(lifted.sum())} of them ran under a longer cap: few requests had arrived "
            f"while the engine worked ({rate:.2g}/s), so a step without decodes could take "
            "longer; the cap returns once arrivals keep finding the engine busy "
            "(docs/slo.md).")


def explain(c: CauseShare, mt: MetricTail, s: Samples, run: RunData,
            model: StepModel | None) -> None:
    """Fill ``c.evidence`` and ``c.advice`` in place."""
    hit = c.seconds > 0
    tail_t = s.t[mt.tail]
    ev: dict[str, Any] = {
        "tail_samples_affected": int(hit.sum()),
        "tail_samples": len(mt.tail),
        "mean_ms_per_affected_sample": _ms(c.seconds[hit].mean()) if hit.any() else 0.0,
        "windows_s": time_ranges(tail_t[hit], run.start_time or 0.0) if hit.any() else [],
    }
    steps = run.steps
    if c.cause == "none":
        ratio = mt.threshold_s / mt.p50_s if mt.p50_s > 0 else 1.0
        ev = {"tail_over_median": round(ratio, 2)}
        c.advice = mt.none_reason or (
            f"the P{mt.percentile:g} is {ratio:.2f}× the median, within the "
            f"{NONE_FACTOR:g}× a healthy server shows: no tail to fix.")
    elif c.cause == "queueing":
        offered, served = load_rates(run)
        over = (offered / served - 1.0) * 100.0 if served > 0 else 0.0
        qv = [float((q.timing or {}).get("queue_s") or 0.0) for q in run.requests if q.timing]
        if qv:
            ev |= {"queue_p50_ms": _ms(np.median(qv)), "queue_max_ms": _ms(max(qv))}
        ev |= {"served_req_per_s": round(served, 3)}
        if run.closed_loop:
            ev["load"] = ("closed loop" if run.max_concurrency is not None
                          else "all at once (--request-rate inf)")
        else:
            ev["offered_req_per_s"] = round(offered, 3)
        grow = None
        if steps is not None and len(steps) and steps.waiting.max() > 0:
            peak = int(np.argmax(steps.waiting))
            ev |= {"max_waiting": int(steps.waiting[peak]),
                   "max_waiting_at_s": _rel(run, steps.t[peak])}
            grow = _rel(run, steps.t[int(np.argmax(steps.waiting > 0))])
        start = f"from t={grow:g} s" if grow is not None else "during the run"
        if run.closed_loop:
            how = (f"--max-concurrency {run.max_concurrency} keeps that many requests in "
                   "flight" if run.max_concurrency is not None
                   else "--request-rate inf sends every request at once")
            c.advice = (f"the queue grows {start} because the client offers load as fast as "
                        f"the server takes it ({how}): the wait measures the run's own "
                        f"backlog, not traffic. Capacity at this mix is about {served:.3g} "
                        "req/s; to see latency under traffic, rerun open-loop below it "
                        f"(--request-rate {0.8 * served:.2g}).")
        elif over > 5:
            c.advice = (f"the queue grows {start}: offered load ({offered:.3g} req/s) exceeds "
                        f"capacity ({served:.3g} req/s) by {over:.0f}%; add capacity, or bound "
                        "the queue (--max-queue-len) so excess load gets 429 instead of waiting.")
        else:
            c.advice = (f"requests wait for admission {start} in bursts: smooth the arrivals, "
                        "add headroom, or raise --max-num-seqs if memory allows.")
    elif c.cause == "prefill_interference":
        if model is not None:
            ev |= {"ms_per_1k_prefill_tokens": round(float(model.prefill_cost(1000.0)) * 1e3, 3),
                   "step_model_r2": round(model.r2, 3)}
        if steps is not None and len(steps):
            big = int(np.argmax(steps.prefill))
            ev |= {"steps_with_prefill": int((steps.prefill > 0).sum()),
                   "largest_prefill_tokens": int(steps.prefill[big]),
                   "largest_prefill_step_ms": _ms(steps.step_s[big]),
                   "largest_prefill_at_s": _rel(run, steps.t[big])}
        c.advice = _interference_advice(steps, ev, mt.metric)
    elif c.cause == "own_prefill":
        lens = np.array([run.requests[int(i)].prompt_len for i in s.req], dtype=float)
        ev |= {"tail_prompt_tokens_median": float(np.median(lens[mt.tail])),
               "all_prompt_tokens_median": float(np.median(lens))}
        if model is not None:
            ev["ms_per_1k_prefill_tokens"] = round(float(model.prefill_cost(1000.0)) * 1e3, 3)
        c.advice = ("the tail requests have long prompts and pay for their own prefill: "
                    "enable prefix caching for shared prefixes, shorten prompts, or set a TTFT "
                    "SLO per prompt length rather than one for all.")
    elif c.cause == "preemption":
        pre = [q.timing for q in run.requests if q.timing and q.timing.get("num_preemptions")]
        ev |= {"preempted_requests": len(pre),
               "preemptions": int(sum(int(t.get("num_preemptions") or 0) for t in pre)),
               "preempted_ms_total": _ms(sum(float(t.get("preempted_s") or 0.0) for t in pre))}
        if steps is not None and len(steps) and steps.preemptions.any():
            ev["preemption_windows_s"] = time_ranges(steps.t[steps.preemptions > 0],
                                                     run.start_time or 0.0)
        c.advice = ("requests are preempted and recomputed when KV blocks run out: raise "
                    "--kv-cache-memory (or --gpu-memory-utilization), lower --max-num-seqs, or "
                    "use --admission-policy reserve.")
    elif c.cause == "kv_cache_pressure":
        if steps is not None and len(steps):
            kv = np.array([b == BLOCKED_KV for b in steps.blocked_by])
            ev |= {"steps_blocked_by_kv_cache": int(kv.sum()),
                   "share_of_steps": round(float(kv.mean()), 4),
                   "min_free_blocks": int(steps.free_blocks.min()),
                   "max_kv_usage": round(float(steps.kv_usage.max()), 4)}
            if kv.any():
                ev["blocked_windows_s"] = time_ranges(steps.t[kv], run.start_time or 0.0)
        c.advice = ("admission waits for free KV blocks, not for a sequence slot: raise "
                    "--kv-cache-memory or lower --max-num-seqs (or --watermark).")
    elif c.cause == "engine_stall":
        if steps is not None and model is not None and model.stall.any():
            worst = int(np.argmax(model.stall))
            ev |= {"stall_steps": int((model.stall > 0).sum()),
                   "worst_stall_ms": _ms(model.stall[worst]),
                   "worst_stall_at_s": _rel(run, steps.t[worst]),
                   "worst_stall_batch": {"decode_seqs": int(steps.decode[worst]),
                                         "prefill_tokens": int(steps.prefill[worst])},
                   "residual_sigma_ms": _ms(model.sigma_s), "step_noise_ms": _ms(model.noise_s)}
        c.advice = ("steps took far longer than their batch explains: look for GC pauses, "
                    "CPU contention (other processes, too many threads) or allocator stalls "
                    "at those times.")
    elif c.cause == "cpu_contention":
        a, b = intervals(s, run)
        ev |= contention_evidence(run, a[mt.tail][hit], b[mt.tail][hit])
        c.advice = ("other processes took the cores tailserve computes on (its kernels use "
                    "every core they are given): move that work off this host, or give "
                    "tailserve cores of its own (a cpuset, or taskset for the rest).")
    elif c.cause == "client_or_network":
        part = s.parts.get("client_or_network")
        if part is not None:
            good = part[~np.isnan(part)]
            ev |= {"client_minus_server_p50_ms": _ms(np.median(good)),
                   "client_minus_server_p99_ms": _ms(np.percentile(good, 99))}
        c.advice = ("time the server does not see: check the client host's load (the bench's "
                    "send lag), its event loop, and the network path; run the client nearer.")
    if not run.has_timing and run.series is not None:
        ev = _engine_view(c.cause, ev, run)
    if not run.has_timing and run.engine.family != "tailserve":
        c.advice = _engine_advice(c, run, c.advice)
    c.evidence = ev
    c.text = sentences(ev) if c.cause != "none" else c.advice
    c.basis = run.engine.basis.get(c.cause, "")


# Evidence an explain branch computes from tailserve's timing or steps, meaningless without them.
_TIMING_ONLY = {"preemption": ("preempted_requests", "preemptions", "preempted_ms_total"),
                "kv_cache_pressure": ()}


def _engine_view(cause: str, ev: dict[str, Any], run: RunData) -> dict[str, Any]:
    """Another engine's counters and gauges: its own figures replace the timing-based ones."""
    ev = {k: v for k, v in ev.items() if k not in _TIMING_ONLY.get(cause, ())}
    return ev | signal_evidence(cause, run)


def _engine_advice(c: CauseShare, run: RunData, generic: str) -> str:
    """Advice in the engine's own flags. A closed-loop queue is the client's backlog, whatever
    the engine, and stays as explain() said it; a cause the engine has no sentence for gets
    the flag-free one of OTHER, never another engine's flags."""
    from tailserve.analyze.engines import OTHER

    if c.cause == "none" or (c.cause == "queueing" and run.closed_loop):
        return generic
    key = c.cause
    if key == "queueing":
        offered, served = load_rates(run)
        key = "queueing" if served > 0 and offered > 1.05 * served else "queueing_burst"
    return run.engine.advice.get(key) or OTHER.advice.get(key) or generic
