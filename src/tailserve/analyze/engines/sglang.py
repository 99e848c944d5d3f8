"""SGLang: the ``sglang:`` gauges and histograms (with ``--enable-metrics``).

It shows running and queued requests, the KV pool's token usage (a 0-1 fraction) and
per-request histograms (TTFT, ITL, end-to-end, queue time). Retractions (SGLang's
preemption) are not exported as a counter, and there are no step durations.
"""

from __future__ import annotations

from tailserve.analyze.engines.base import (
    CONTENTION_BASIS,
    COUNTER,
    FRACTION,
    GAUGE,
    Engine,
    Signal,
)

ENGINE = Engine(
    family="sglang", name="SGLang", prefix="sglang:", owned_by=("sglang",),
    signals={
        "running": Signal("sglang:num_running_reqs", GAUGE),
        "waiting": Signal("sglang:num_queue_reqs", GAUGE),
        "kv_usage": Signal("sglang:token_usage", FRACTION),
        "queue_sum": Signal("sglang:queue_time_seconds_sum", COUNTER),
        "queue_count": Signal("sglang:queue_time_seconds_count", COUNTER),
        "ttft_sum": Signal("sglang:time_to_first_token_seconds_sum", COUNTER),
        "ttft_count": Signal("sglang:time_to_first_token_seconds_count", COUNTER),
        "e2e_sum": Signal("sglang:e2e_request_latency_seconds_sum", COUNTER),
        "e2e_count": Signal("sglang:e2e_request_latency_seconds_count", COUNTER),
        "prompt_tokens": Signal("sglang:prompt_tokens_total", COUNTER),
    },
    basis={
        "cpu_contention": CONTENTION_BASIS,
        "queueing": "TTFT against the requests still waiting for a first token, with "
                    "sglang:num_queue_reqs and the sglang:queue_time_seconds histogram",
        "kv_cache_pressure": "the wait spent while sglang:num_queue_reqs > 0 with "
                             "sglang:token_usage near full",
        "own_prefill": "TTFT against prompt length (client clock)",
        "prefill_interference": "ITL gaps that hold other requests' first tokens (client clock)",
    },
    missing={
        "preemption": "SGLang exports no counter of retracted requests; a retraction counter "
                      "or its request traces would let it be judged",
        "engine_stall": "SGLang exports no per-step durations; its traces would let it be "
                        "judged",
        "client_or_network": "SGLang has no per-request server timing in its responses",
    },
    advice={
        "cpu_contention": ("other processes took the cores SGLang computes on: "
                           "move that work off this host, or run SGLang on cores of its own "
                           "(a cpuset, or taskset for the rest)."),
        "queueing": "offered load exceeds what SGLang serves at this mix: add replicas or "
                    "raise --max-running-requests if the KV pool allows; shed load at the "
                    "router.",
        "queueing_burst": "requests wait in bursts: smooth the arrivals, add headroom, or raise "
                          "--max-running-requests if the KV pool allows.",
        "kv_cache_pressure": "requests wait for KV pool tokens: raise --mem-fraction-static, "
                             "or lower --max-running-requests / --context-length.",
        "prefill_interference": "long prompts stall running decodes: lower "
                                "--chunked-prefill-size so prompts are split into smaller "
                                "chunks.",
        "own_prefill": "the tail requests pay for their own long prompts: keep RadixAttention "
                       "prefix caching on for shared prefixes, shorten prompts, or give long "
                       "prompts their own TTFT SLO.",
    },
)
