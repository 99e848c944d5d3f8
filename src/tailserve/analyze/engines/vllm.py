"""vLLM (V1 engine): the ``vllm:`` gauges, counters and histograms.

What it shows: the scheduler's running and waiting counts and the KV cache's usage (gauges),
preemptions and tokens (counters), and per-request histograms of queue, prefill and decode
time, TTFT, ITL and end-to-end latency, read here as per-window sums and counts. What it does
not show: step durations (so no step model, no stalls) and, in /metrics, per-request server
timing (so the client's time cannot be split from the server's). Its OpenTelemetry request
spans have that timing: ``with_spans`` is vLLM read with them (analyze/otlp.py).
"""

from __future__ import annotations

from dataclasses import replace

from tailserve.analyze.engines.base import (
    CONTENTION_BASIS,
    COUNTER,
    FRACTION,
    GAUGE,
    Engine,
    Signal,
)

ENGINE = Engine(
    family="vllm", name="vLLM", prefix="vllm:", owned_by=("vllm",),
    signals={
        "running": Signal("vllm:num_requests_running", GAUGE),
        "waiting": Signal("vllm:num_requests_waiting", GAUGE),
        "kv_usage": Signal("vllm:kv_cache_usage_perc", FRACTION),
        "kv_usage_old": Signal("vllm:gpu_cache_usage_perc", FRACTION),  # before V1
        "preemptions": Signal("vllm:num_preemptions_total", COUNTER),
        "queue_sum": Signal("vllm:request_queue_time_seconds_sum", COUNTER),
        "queue_count": Signal("vllm:request_queue_time_seconds_count", COUNTER),
        "prefill_sum": Signal("vllm:request_prefill_time_seconds_sum", COUNTER),
        "prefill_count": Signal("vllm:request_prefill_time_seconds_count", COUNTER),
        "ttft_sum": Signal("vllm:time_to_first_token_seconds_sum", COUNTER),
        "ttft_count": Signal("vllm:time_to_first_token_seconds_count", COUNTER),
        "e2e_sum": Signal("vllm:e2e_request_latency_seconds_sum", COUNTER),
        "e2e_count": Signal("vllm:e2e_request_latency_seconds_count", COUNTER),
        "prompt_tokens": Signal("vllm:prompt_tokens_total", COUNTER),
    },
    basis={
        "cpu_contention": CONTENTION_BASIS,
        "queueing": "TTFT against the requests still waiting for a first token, with "
                    "vllm:num_requests_waiting and the vllm:request_queue_time_seconds "
                    "histogram's per-window deltas",
        "kv_cache_pressure": "the wait spent while vllm:num_requests_waiting > 0 with "
                             "vllm:kv_cache_usage_perc near full",
        "preemption": "vllm:num_preemptions_total deltas per window, charged to the longest "
                      "stalls of running requests in those windows",
        "own_prefill": "TTFT against prompt length (client clock)",
        "prefill_interference": "ITL gaps that hold other requests' first tokens (client clock)",
    },
    missing={
        "engine_stall": "vLLM exports no per-step durations (its request spans carry none "
                        "either); a step timeline would let it be judged",
        "client_or_network": "vLLM has no per-request server timing in its responses; its "
                             "request spans (vllm serve --otlp-traces-endpoint into an "
                             "OpenTelemetry collector's file exporter, read with diagnose "
                             "--otlp-traces FILE) would let client time be split from server "
                             "time",
    },
    advice={
        "cpu_contention": ("other processes took the cores vLLM computes on: move "
                           "that work off this host, or give vLLM's OpenMP threads cores of "
                           "their own (VLLM_CPU_OMP_THREADS_BIND, with "
                           "VLLM_CPU_NUM_OF_RESERVED_CPU left for its serving process)."),
        "queueing": "offered load exceeds what vLLM serves at this mix: add replicas, or "
                    "raise --max-num-seqs / --max-num-batched-tokens if KV memory allows; "
                    "vLLM has no queue bound, so shed load at the router.",
        "queueing_burst": "requests wait for admission in bursts: smooth the arrivals, add "
                          "headroom, or raise --max-num-seqs if KV memory allows.",
        "kv_cache_pressure": "requests wait for free KV blocks, not for a sequence slot: give "
                             "the KV cache more memory (--gpu-memory-utilization; on CPU "
                             "VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes) or lower "
                             "--max-num-seqs / --max-model-len.",
        "preemption": "vLLM preempts (recomputes) running requests when KV blocks run out: "
                      "give the KV cache more memory (--gpu-memory-utilization; on CPU "
                      "VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes), or lower "
                      "--max-num-seqs so fewer sequences share it.",
        "prefill_interference": "long prompts stall running decodes: lower "
                                "--max-num-batched-tokens or --long-prefill-token-threshold "
                                "so a prompt is split into smaller chunks, or cap concurrent "
                                "long prefills (--max-long-partial-prefills).",
        "own_prefill": "the tail requests pay for their own long prompts: enable prefix "
                       "caching (--enable-prefix-caching) for shared prefixes, shorten prompts, "
                       "or give long prompts their own TTFT SLO or --scheduling-policy "
                       "priority for short ones.",
    },
)

# With its request spans (diagnose --otlp-traces, analyze/otlp.py) vLLM tells each request's
# own queue and prefill time and its server-side TTFT, so those causes rest on measurements
# and the client's time can be split from the server's.
_SPAN_BASIS = {
    "queueing": "each request's gen_ai.latency.time_in_queue from vLLM's llm_request spans, "
                "split from KV pressure by vllm:num_requests_waiting and "
                "vllm:kv_cache_usage_perc where recorded",
    "kv_cache_pressure": "the span's gen_ai.latency.time_in_queue spent while "
                         "vllm:num_requests_waiting > 0 with vllm:kv_cache_usage_perc near full",
    "own_prefill": "the request's prompt (gen_ai.usage.prompt_tokens) at the run's quickest "
                   "prefill price, from the spans' gen_ai.latency.time_in_model_prefill",
    "prefill_interference": "the rest of the span's gen_ai.latency.time_in_model_prefill "
                            "(other requests in its steps); ITL gaps that hold other requests' "
                            "first tokens (client clock)",
    "client_or_network": "the client's TTFT and E2EL less the span's "
                         "gen_ai.latency.time_to_first_token and gen_ai.latency.e2e",
}


def with_spans(engine: Engine) -> Engine:
    """vLLM read with its request spans: the span-based basis, client time no longer missing."""
    return replace(engine, basis=engine.basis | _SPAN_BASIS,
                   missing={k: v for k, v in engine.missing.items()
                            if k != "client_or_network"})
