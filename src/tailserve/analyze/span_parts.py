"""Per-request parts from vLLM's request spans, replacing the fitted ones where a span exists.

Without spans, another engine's TTFT is split by regression on the client's clock (TTFT
against prompt length and the queue ahead, samples.client_samples). A vLLM ``llm_request``
span (analyze/otlp.py) measures what the fit guessed, per request:

- **queueing**: ``time_in_queue``; where the engine's gauges were recorded, the share of the
  request's wait that counters.py found KV-bound moves to **kv_cache_pressure** as before;
- **own_prefill**: the request's prompt at the run's quickest prefill price
  (``PRICE_QUANTILE`` of ``time_in_model_prefill`` per prompt token over the spans), at most
  its own prefill window: what the prompt costs when nothing else shares its steps;
- **prefill_interference**: the rest of ``time_in_model_prefill``: the other requests'
  tokens in its steps, its chunks waiting for the token budget;
- **client_or_network**: the client's TTFT (E2EL, decode time for TPOT) less the span's:
  the network, the HTTP server and the client's own loop. Both are durations on one host's
  clock each, so no clock offset enters.

What the span cannot split: a preemption before the first token (vLLM keeps the first
scheduling time, so it stays inside the prefill window, read as interference) and prefix
cache hits (the span has no cached-token count: a cached prompt looks quick, which lowers
the price). The time between arrival and queueing (tokenizing, the hop to the engine core)
is in no part: the decomposition's ``rest_ms``.
"""

from __future__ import annotations

import numpy as np

from tailserve.analyze.data import RunData
from tailserve.analyze.samples import Samples

PRICE_QUANTILE = 10.0  # percent: the run's quickest prefill price, robust to one outlier


def prefill_price(run: RunData) -> float:
    """Seconds per prompt token of the run's quickest prefills (0 when no span says)."""
    per = [q.span.prefill_s / q.span.prompt_tokens for q in run.requests
           if q.span is not None and q.span.prompt_tokens]
    return float(np.percentile(per, PRICE_QUANTILE)) if per else 0.0


def apply_spans(run: RunData, samples: dict[str, Samples]) -> int:
    """Overwrite the parts of every TTFT, E2EL and TPOT sample whose request has a span, in
    place; returns how many TTFT samples now rest on a span."""
    price = prefill_price(run)
    covered = 0
    for metric in ("ttft", "e2el", "tpot"):
        s = samples.get(metric)
        if s is None or not len(s.values):
            continue
        n = len(s.values)
        names = ("client_or_network",) if metric == "tpot" else (
            "queueing", "own_prefill", "prefill_interference", "client_or_network")
        for name in names:
            s.parts.setdefault(name, np.zeros(n))
        for k in range(n):
            q = run.requests[int(s.req[k])]
            sp = q.span
            if sp is None:
                continue
            covered += metric == "ttft"
            if metric == "tpot":
                # Only the client's share of the decode differs from the fit's view.
                if sp.decode_s is not None and q.ttft_s is not None and q.e2el_s is not None:
                    gaps = max(q.output_tokens - 1, 1)
                    s.parts["client_or_network"][k] = max(
                        0.0, (q.e2el_s - q.ttft_s) - sp.decode_s) / gaps
                continue
            # Keep counters.py's KV-bound share of the wait, now of the measured wait.
            q_fit = float(s.parts["queueing"][k])
            kv = s.parts.get("kv_cache_pressure")
            kv_fit = float(kv[k]) if kv is not None else 0.0
            kv_share = kv_fit / (q_fit + kv_fit) if q_fit + kv_fit > 0 else 0.0
            s.parts["queueing"][k] = sp.queue_s * (1.0 - kv_share)
            if kv is not None:
                kv[k] = sp.queue_s * kv_share
            own = min(sp.prefill_s, price * float(sp.prompt_tokens or q.prompt_len))
            s.parts["own_prefill"][k] = own
            interference = sp.prefill_s - own
            if metric == "e2el":
                # Later gaps that held other requests' prefill (the fit's, client clock) stay.
                interference += float(s.parts["prefill_interference"][k])
            s.parts["prefill_interference"][k] = interference
            server = sp.ttft_s if metric == "ttft" else sp.e2e_s
            if server is not None:
                s.parts["client_or_network"][k] = max(0.0, float(s.values[k]) - server)
    return covered
