"""The numbers of a step, defined as vLLM's ``bench serve`` defines them.

Over the *successful* requests:

- TTFT: send → first content chunk (client.py defines a content chunk);
- TPOT: per request, (E2EL − TTFT) / (output_tokens − 1), for requests with more than one
  output token (for goodput a one-token request counts as TPOT 0, as in vLLM);
- ITL: every gap between consecutive content chunks, pooled over all requests;
- E2EL: send → the response complete;
- output tokens: the server's ``usage.completion_tokens`` (a tokenizer count or the number of
  content chunks only when a server sends no usage; the result says which);
- throughputs divide by the step's duration (first arrival scheduled → last response done):
  completed requests, output tokens, input + output tokens per second;
- goodput: requests per second that meet every SLO given (bench/goodput.py: TTFT, every
  ITL gap, TPOT, E2EL; vLLM's ``--goodput ttft:MS`` judges the same way).

Every distribution gets mean, median, std (population, numpy's default) and the chosen
percentiles (numpy's linear interpolation), in milliseconds, under vLLM's key names
(``p99_ttft_ms``, ``p99.9_e2el_ms``). Empty distributions report 0, as vLLM does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from tailserve.bench.client import RequestResult
from tailserve.bench.goodput import Goodput, SloSpec, Verdict, goodput, judge


def p_word(p: float) -> str:
    """vLLM's percentile spelling in keys: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def distribution(values: Sequence[float], percentiles: Sequence[float],
                 scale: float = 1.0) -> dict[str, float]:
    """mean, median, std and p<NN> of ``values``·``scale``; zeros when empty (vLLM's rule)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * scale
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{p_word(p)}"] = float(np.percentile(arr, p))
    return out


def tpot_s(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.e2el_s is None or not r.output_tokens or r.output_tokens < 2:
        return None
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1)


def max_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once, exactly (vLLM buckets by whole seconds, which
    can only overcount): a sweep over send and end events, ends first at equal times."""
    events: list[tuple[float, int]] = []
    for r in results:
        if r.send_s is not None and r.end_s is not None:
            events += [(r.send_s, 1), (r.end_s, -1)]
    events.sort(key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def peak_output_tokens_per_s(results: Sequence[RequestResult]) -> float:
    """vLLM's ``max_output_tokens_per_s``: content chunks per whole second of the run, at
    their arrival times (one chunk counted as one token, as vLLM counts it)."""
    times: list[float] = []
    for r in results:
        if r.success and r.send_s is not None and r.ttft_s is not None:
            t = r.send_s + r.ttft_s
            times.append(t)
            for gap in r.itl_s:
                t += gap
                times.append(t)
    if not times:
        return 0.0
    start = min(r.send_s for r in results if r.send_s is not None)
    buckets = np.bincount(np.floor(np.asarray(times) - start).astype(np.int64).clip(0))
    return float(buckets.max())


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    goodput: SloSpec | dict[str, float] | None = None,
) -> dict[str, Any]:
    """vLLM's result keys for one step (``goodput``: the SLOs, or vLLM's NAME -> ms)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2els = [r.e2el_s for r in ok if r.e2el_s is not None]
    itls = [g for r in ok for g in r.itl_s]
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens or 0 for r in ok)
    slos = SloSpec.from_ms(goodput) if isinstance(goodput, dict) else goodput
    good = step_goodput(results, slos, duration_s).num_good if slos else None
    dur = duration_s if duration_s > 0 else float("nan")
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "request_goodput": None if good is None else good / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "max_output_tokens_per_s": peak_output_tokens_per_s(results),
        "max_concurrent_requests": max_concurrency(results),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, v in distribution(values, percentiles, scale=1000.0).items():
            out[f"{stat}_{name}_ms"] = v
    return out


def client_summary(results: Sequence[RequestResult],
                   percentiles: Sequence[float]) -> dict[str, Any]:
    """What vLLM's keys do not hold: failures by status and type, the lengths sent, the
    client's send lag, where output token counts came from."""
    failed = [r for r in results if not r.success]
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error_type or "not_sent", r.error or "")
    sent = [r for r in results if r.send_s is not None]
    lags = [r.lag_s for r in sent if r.lag_s is not None]
    return {
        "failures": {
            "by_status": dict(Counter(str(r.status) if r.status else "none" for r in failed)),
            "by_type": dict(Counter(r.error_type or "not_sent" for r in failed)),
            "examples": examples,
        },
        "lengths": {
            "input": distribution([r.prompt_len for r in results], percentiles),
            "output_requested": distribution([r.output_len for r in results], percentiles),
            "output_received": distribution(
                [r.output_tokens or 0 for r in results if r.success], percentiles),
            "input_min": min((r.prompt_len for r in results), default=0),
            "input_max": max((r.prompt_len for r in results), default=0),
        },
        "send_lag_ms": {**distribution(lags, percentiles, scale=1000.0),
                        "max": 1000.0 * max(lags, default=0.0)},
        "output_tokens_source": dict(Counter(
            r.output_tokens_source for r in results if r.success and r.output_tokens_source)),
    }


def verdict(r: RequestResult, slos: SloSpec) -> Verdict:
    return judge(slos, r.success, r.ttft_s, r.itl_s, r.output_tokens, r.e2el_s)


def step_goodput(results: Sequence[RequestResult], slos: SloSpec,
                 duration_s: float) -> Goodput:
    """The step's goodput: every request sent counts (a failed one meets no SLO)."""
    return goodput(slos, [verdict(r, slos) for r in results], duration_s)
