"""A cause's evidence as sentences a person reads, with units; the raw figures stay in --json.

Each template names the evidence keys it needs and is said only when all are present, so a
cause judged from an engine's counters (no step timeline) reads as well as one measured on
tailserve's timeline. A key no template knows (a cause added later) is still said, as "its
name: value".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _ranges(rs: list[list[float]]) -> str:
    parts = [f"t={a:g} s" if a == b else f"t={a:g}–{b:g} s" for a, b in rs]
    return ", ".join(parts)


def _dur(ms: float) -> str:
    """Milliseconds as a person says them: "8.4 ms", "162.2 s"."""
    return f"{ms / 1e3:.1f} s" if ms >= 10_000 else f"{ms:.1f} ms"


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


# (keys, sentence) in the order they are said.
_Template = tuple[tuple[str, ...], Callable[[dict[str, Any]], str]]
TEMPLATES: list[_Template] = [
    (("tail_samples_affected", "tail_samples", "mean_ms_per_affected_sample"),
     lambda e: f"It adds {_dur(e['mean_ms_per_affected_sample'])} on average to "
               f"{e['tail_samples_affected']} of the {e['tail_samples']} tail samples."),
    (("windows_s",), lambda e: f"Those samples fall at {_ranges(e['windows_s'])}."
     if e["windows_s"] else ""),
    # queueing
    (("queue_p50_ms", "queue_max_ms"),
     lambda e: f"The server's queue time was {_dur(e['queue_p50_ms'])} at the median and "
               f"up to {_dur(e['queue_max_ms'])}."),
    (("offered_req_per_s", "served_req_per_s"),
     lambda e: f"The client offered {e['offered_req_per_s']:g} req/s and the server "
               f"completed {e['served_req_per_s']:g} req/s."),
    (("load", "served_req_per_s"),
     lambda e: f"The load was {e['load']}; the server completed {e['served_req_per_s']:g} "
               "req/s."),
    (("max_waiting", "max_waiting_at_s"),
     lambda e: f"Up to {e['max_waiting']} requests waited, at t={e['max_waiting_at_s']:g} s."),
    (("max_waiting",), lambda e: f"Up to {e['max_waiting']} requests waited at once."),
    (("slots", "all_slots_busy_share"),
     lambda e: f"All {e['slots']} slots were busy in {_pct(e['all_slots_busy_share'])} of the "
               "samples of /slots."),
    (("max_slot_context_use",),
     lambda e: f"The fullest busy slot held {_pct(e['max_slot_context_use'])} of its context."),
    (("server_queue_mean_ms",),
     lambda e: f"The server's queue-time histogram says {_dur(e['server_queue_mean_ms'])} per "
               "request on average"
               + (f", {_dur(e['server_queue_worst_window_mean_ms'])} in the worst window "
                  f"(t={e['server_queue_worst_window_at_s']:g} s)."
                  if "server_queue_worst_window_mean_ms" in e else ".")),
    # cpu_contention
    (("other_cores_tail_mean", "host_cores", "other_cores_run_mean"),
     lambda e: f"Other processes on the server's host used {e['other_cores_tail_mean']:g} of "
               f"its {e['host_cores']} cores during the tail samples, against "
               f"{e['other_cores_run_mean']:g} over the whole run."),
    (("server_wait_share_tail",),
     lambda e: f"The server's threads waited for a CPU {_pct(e['server_wait_share_tail'])} of "
               "the time they were ready to run."),
    (("other_cores_max", "other_cores_max_at_s"),
     lambda e: f"At most {e['other_cores_max']:g} cores, at t={e['other_cores_max_at_s']:g} s."),
    # kv_cache_pressure
    (("steps_blocked_by_kv_cache", "share_of_steps"),
     lambda e: f"{e['steps_blocked_by_kv_cache']} steps ({_pct(e['share_of_steps'])}) held "
               "admission back for free KV blocks."),
    (("kv_bound_share_of_run",),
     lambda e: f"Requests waited while the KV cache was near full for "
               f"{_pct(e['kv_bound_share_of_run'])} of the run."),
    (("max_kv_usage",), lambda e: f"KV cache usage peaked at {_pct(e['max_kv_usage'])}."),
    (("min_free_blocks",), lambda e: f"Free KV blocks fell to {e['min_free_blocks']}."),
    (("blocked_windows_s",),
     lambda e: f"Admission was blocked at {_ranges(e['blocked_windows_s'])}."),
    (("kv_bound_windows_s",), lambda e: f"The KV cache was the limit at "
                                        f"{_ranges(e['kv_bound_windows_s'])}."),
    # preemption
    (("preempted_requests", "preemptions", "preempted_ms_total"),
     lambda e: f"{e['preempted_requests']} requests were preempted {e['preemptions']} times, "
               f"{e['preempted_ms_total'] / 1e3:.2f} s of preempted time in all."),
    (("preemptions",), lambda e: f"The server counted {e['preemptions']} preemptions."
     if "preempted_requests" not in e else ""),
    (("preemption_windows_s",), lambda e: f"Preemptions happened at "
                                          f"{_ranges(e['preemption_windows_s'])}."),
    # prefill
    (("largest_prefill_tokens", "largest_prefill_step_ms", "largest_prefill_at_s"),
     lambda e: f"The largest prefill, {e['largest_prefill_tokens']} tokens at "
               f"t={e['largest_prefill_at_s']:g} s, made a {e['largest_prefill_step_ms']:.1f} ms "
               "step."),
    (("steps_with_prefill",), lambda e: f"{e['steps_with_prefill']} steps carried prefill."),
    (("ms_per_1k_prefill_tokens",),
     lambda e: f"The step model prices prefill at {e['ms_per_1k_prefill_tokens']:.1f} ms per "
               "1,000 tokens" + (f" (R² {e['step_model_r2']:.2f})." if "step_model_r2" in e
                                 else ".")),
    (("server_ms_per_1k_prompt_tokens",),
     lambda e: f"The server's own counters price a prompt at "
               f"{e['server_ms_per_1k_prompt_tokens']:.1f} ms per 1,000 tokens."),
    (("tail_prompt_tokens_median", "all_prompt_tokens_median"),
     lambda e: f"Tail requests had {e['tail_prompt_tokens_median']:.0f}-token prompts at the "
               f"median, against {e['all_prompt_tokens_median']:.0f} for all."),
    (("median_prefill_only_step_ms", "max_prefill_only_step_ms"),
     lambda e: f"Steps without decodes took {e['median_prefill_only_step_ms']:.1f} ms at the "
               f"median and up to {e['max_prefill_only_step_ms']:.1f} ms."),
    (("itl_target_ms", "median_step_with_prefill_ms", "median_decode_only_step_ms"),
     lambda e: f"Steps with prefill took {e['median_step_with_prefill_ms']:.1f} ms at the "
               f"median against an ITL target of {e['itl_target_ms']:.1f} ms and "
               f"{e['median_decode_only_step_ms']:.1f} ms for decode-only steps."),
    # engine_stall
    (("stall_steps", "worst_stall_ms", "worst_stall_at_s"),
     lambda e: f"{e['stall_steps']} steps took far longer than their batch explains; the worst "
               f"added {e['worst_stall_ms']:.1f} ms at t={e['worst_stall_at_s']:g} s."),
    (("step_noise_ms",),
     lambda e: f"19 steps in 20 stay within {e['step_noise_ms']:.2f} ms of the model; a stall "
               "is more than 3 times that."),
    # client_or_network
    (("client_minus_server_p50_ms", "client_minus_server_p99_ms"),
     lambda e: f"Client-measured minus server-measured time: "
               f"{e['client_minus_server_p50_ms']:.1f} ms at the median, "
               f"{e['client_minus_server_p99_ms']:.1f} ms at P99."),
]
# Figures said inside another key's sentence, or only for machines.
_QUIET = {"step_model_r2", "server_queue_worst_window_mean_ms", "server_queue_worst_window_at_s",
          "residual_sigma_ms", "worst_stall_batch", "tail_over_median"}


def sentences(evidence: dict[str, Any]) -> str:
    out, used = [], set(_QUIET)
    for keys, say in TEMPLATES:
        if all(k in evidence for k in keys) and not set(keys) <= used:
            text = say(evidence)
            if text:
                out.append(text)
            used |= set(keys)
    rest = [f"{k.replace('_', ' ')}: {v}" for k, v in evidence.items() if k not in used]
    if rest:
        out.append("; ".join(rest) + ".")
    return " ".join(out)
