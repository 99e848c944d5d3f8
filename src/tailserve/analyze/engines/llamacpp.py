"""llama.cpp's llama-server: the ``llamacpp:`` counters and gauges (with ``--metrics``).

It shows the requests being processed and deferred (every slot busy), and counters of prompt
tokens and the seconds spent on them, so the server's own price of a prompt token per window;
its ``/slots`` (sampled with ``/metrics``) shows each slot's context size, whether it is busy
and the tokens it holds.
It never preempts (a slot keeps its KV until its request ends) and exports no KV usage and no
step durations.
"""

from __future__ import annotations

from tailserve.analyze.engines.base import CONTENTION_BASIS, COUNTER, GAUGE, Engine, Signal

ENGINE = Engine(
    family="llama.cpp", name="llama-server", prefix="llamacpp:", owned_by=("llamacpp",),
    signals={
        "running": Signal("llamacpp:requests_processing", GAUGE),
        "waiting": Signal("llamacpp:requests_deferred", GAUGE),
        "prompt_tokens": Signal("llamacpp:prompt_tokens_total", COUNTER),
        "prompt_seconds": Signal("llamacpp:prompt_seconds_total", COUNTER),
        "decode_calls": Signal("llamacpp:n_decode_total", COUNTER),
    },
    basis={
        "cpu_contention": CONTENTION_BASIS,
        "queueing": "TTFT against the requests still waiting for a first token, with "
                    "llamacpp:requests_deferred and /slots (every slot busy)",
        "own_prefill": "TTFT against prompt length, priced by llamacpp:prompt_seconds_total "
                       "over llamacpp:prompt_tokens_total",
        "prefill_interference": "ITL gaps that hold other requests' first tokens (client clock)",
    },
    missing={
        "preemption": "llama-server never preempts: a slot keeps its KV cache until its "
                      "request ends (a request that does not fit its slot fails instead)",
        "kv_cache_pressure": "llama-server never waits for KV: a request waits for a slot, "
                             "and in its slot it fails or shifts its context when that is "
                             "full (/slots, recorded with each sample, says how full the "
                             "fullest slot was)",
        "engine_stall": "llama-server exports no per-step durations; only the mean decode "
                        "time per window (llamacpp:tokens_predicted_seconds_total)",
        "client_or_network": "llama-server has no per-request server timing in streamed "
                             "responses",
    },
    advice={
        "cpu_contention": ("other processes took the cores llama-server computes "
                           "on: move that work off this host, or pin it to cores of its own "
                           "(--cpu-range / --cpu-mask, and --threads no more than those "
                           "cores) and raise its --prio."),
        "queueing": "every slot is busy and requests are deferred: raise --parallel (with "
                    "--kv-unified or a larger -c so each slot keeps enough context), or add "
                    "servers.",
        "queueing_burst": "requests wait for a free slot in bursts: raise --parallel (and -c "
                          "with it), or smooth the arrivals.",
        "prefill_interference": "prompts are processed in the same batches as running "
                                "decodes: a smaller --batch-size / --ubatch-size splits a "
                                "long prompt across more, shorter batches.",
        "own_prefill": "the tail requests pay for their own long prompts: keep --cache-prompt "
                       "(the default) for shared prefixes, shorten prompts, or raise "
                       "--ubatch-size for faster prompt processing.",
    },
)
