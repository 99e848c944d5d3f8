"""Engines as adapters: each family's module maps what it exposes onto diagnose's signals.

``identify`` picks the family from the ``/metrics`` names the bench saw (``vllm:``,
``sglang:``, ``llamacpp:``, ``tailserve:``; tailserve also renders a few ``vllm:`` gauges, so
its own prefix wins), else from ``/v1/models``' ``owned_by``. A new family is a module with
an ``ENGINE`` and one entry in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tailserve.analyze.engines import llamacpp, sglang, tailserve, vllm
from tailserve.analyze.engines.base import CONTENTION_BASIS, Engine, Series, build_series

__all__ = ["FAMILIES", "OTHER", "Engine", "Series", "build_series", "identify"]

FAMILIES: tuple[Engine, ...] = (tailserve.ENGINE, vllm.ENGINE, sglang.ENGINE, llamacpp.ENGINE)

_NO_METRICS = "the server's /metrics was not recorded (or the engine is unknown)"
OTHER = Engine(
    family="other", name="an OpenAI-compatible server", prefix="",
    basis={"cpu_contention": CONTENTION_BASIS,
           "queueing": "TTFT against the requests still waiting for a first token (client "
                       "clock)",
           "own_prefill": "TTFT against prompt length (client clock)",
           "prefill_interference": "ITL gaps that hold other requests' first tokens (client "
                                   "clock)"},
    missing={"preemption": f"{_NO_METRICS}; a preemption counter would let it be judged",
             "kv_cache_pressure": f"{_NO_METRICS}; a KV usage gauge and the waiting queue "
                                  "would let it be judged",
             "engine_stall": "no step durations; a step timeline would let it be judged",
             "client_or_network": "no per-request server timing; tailserve_timing or "
                                  "request traces would let it be judged"},
    # Flag-free: the engine is unknown, so no flag of any engine is named.
    advice={"cpu_contention": "other processes took the cores the server computes on: move "
                              "that work off this host, or give the server cores of its own.",
            "queueing": "offered load exceeds what the server completes at this mix: add "
                        "capacity or replicas, or shed load before it queues.",
            "queueing_burst": "requests wait for admission in bursts: smooth the arrivals or "
                              "add headroom (more concurrent sequences, if memory allows).",
            "prefill_interference": "long prompts stall running decodes: split prompts into "
                                    "smaller prefill chunks (the server's chunked-prefill or "
                                    "batch-size setting).",
            "own_prefill": "the tail requests pay for their own long prompts: cache shared "
                           "prefixes, shorten prompts, or give long prompts their own TTFT SLO.",
            "preemption": "requests are preempted when the KV cache runs out: give it more "
                          "memory or run fewer sequences at once.",
            "kv_cache_pressure": "requests wait for KV cache space: give it more memory or run "
                                 "fewer sequences at once."},
)


def identify(metric_names: Iterable[str], owned_by: Iterable[str] = ()) -> Engine:
    names = list(metric_names)
    for engine in FAMILIES:
        if any(n.startswith(engine.prefix) for n in names):
            return engine
    owners = {str(o).lower() for o in owned_by}
    for engine in FAMILIES:
        if owners & set(engine.owned_by):
            return engine
    return OTHER
