"""The ``grammar`` cause: structured output's grammar work on a request's path to its first token.

A constrained request waits for its grammar before it can be scheduled: the API compiles a new
grammar and computes its first mask (``--grammar-timeout-ms`` bounds it; a cached grammar
costs nothing there), then the engine builds the request's matcher off its step loop. Both
happen after the request's arrival and before its first scheduling, so they are inside its
``queue_s``; ``tailserve_timing.grammar_s`` adds them up, with the per-step masks after the
first token (tens of microseconds each).

``samples.py`` splits a request's queue time by what the steps in that wait were doing
(queueing, KV blocks, head-of-line prefill, preemption); a wait for a grammar is none of those.
``carve_grammar`` moves it out: ``min(grammar_s, queue_s)`` (the masks after the first token
are not in the queue, so the bound keeps them out) is taken from the purely queue-derived
parts, ``queueing`` first, then ``kv_cache_pressure``, into a ``grammar`` part of TTFT and
E2EL. Attribution (``attribution.py``) then weighs it like any other part: a schema every
request shares and that is cached costs the tail nothing; a cold or huge schema on a few
requests is named.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.analyze.attribution import CauseShare
from tailserve.analyze.data import RunData
from tailserve.analyze.samples import Samples

GRAMMAR = "grammar"
# The queue-derived parts a grammar wait is taken from, in this order.
_FROM = ("queueing", "kv_cache_pressure")


def _timing(run: RunData, req: np.ndarray, key: str) -> np.ndarray:
    return np.array([float((run.requests[int(i)].timing or {}).get(key) or 0.0) for i in req])


def carve_grammar(samples: dict[str, Samples], run: RunData) -> None:
    """Give TTFT and E2EL samples (the server's, with timing) their ``grammar`` part."""
    for metric in ("ttft", "e2el"):
        s = samples.get(metric)
        if s is None or "queueing" not in s.parts:
            continue
        left = np.minimum(_timing(run, s.req, "grammar_s"), _timing(run, s.req, "queue_s"))
        moved = np.zeros(len(s.values))
        for name in _FROM:
            part = s.parts.get(name)
            if part is None:
                continue
            take = np.minimum(np.nan_to_num(part), left)
            s.parts[name] = part - take
            moved += take
            left -= take
        s.parts[GRAMMAR] = moved


def explain_grammar(c: CauseShare, run: RunData, s: Samples, tail: np.ndarray) -> None:
    """Evidence and advice for a ``grammar`` share (after ``advice.explain``'s common part)."""
    g = _timing(run, s.req, "grammar_s")
    constrained = g > 0
    ev: dict[str, Any] = dict(c.evidence)
    ev |= {"constrained_requests": int(constrained.sum())}
    if constrained.any():
        ev |= {"grammar_p50_ms": round(float(np.median(g[constrained])) * 1e3, 3),
               "grammar_max_ms": round(float(g.max()) * 1e3, 3),
               "tail_grammar_max_ms": round(float(g[tail].max()) * 1e3, 3)}
    c.evidence = ev
    c.advice = ("constrained requests wait for their grammar before they are scheduled: a new "
                "schema is compiled on the path to the first token (each is cached after "
                "that). Reuse schemas across requests, simplify the large ones (deep nesting, "
                "wide anyOf/oneOf), or lower --grammar-timeout-ms so a slow one is refused "
                "with a 400 instead of waited for.")
