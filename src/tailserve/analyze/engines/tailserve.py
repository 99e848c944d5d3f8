"""tailserve: the step and request timeline and each response's ``tailserve_timing``.

Every cause is measured (queue, prefill, preempted time per request; the step model over the
engine's own step records), so nothing is missing; advice is analyze/advice.py's, which also
reads the run's own step sizing (``--slo-itl-ms``).
"""

from __future__ import annotations

from tailserve.analyze.engines.base import CONTENTION_BASIS, Engine

ENGINE = Engine(
    family="tailserve", name="tailserve", prefix="tailserve:", owned_by=("tailserve",),
    basis={
        "cpu_contention": CONTENTION_BASIS,
        "queueing": "each request's queue_s from tailserve_timing, while admission was held "
                    "by --max-num-seqs or the token budget (the timeline's admission_blocked_by)",
        "kv_cache_pressure": "queue_s while the timeline's steps were blocked by free KV blocks",
        "own_prefill": "the request's own prompt priced by the step model",
        "prefill_interference": "the step model's prefill part of the steps in the request's "
                                "window or ITL gap",
        "preemption": "preempted_s from tailserve_timing",
        "engine_stall": "steps beyond the run's own step-time noise (the timeline's step_s "
                        "against the step model)",
        "client_or_network": "client-measured minus server-measured time",
    },
)
