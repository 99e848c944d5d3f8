"""The ``noisy_neighbour`` cause: one tenant's load explains another tenant's tail.

The tenant of each request is the server's ``tailserve_timing.tenant`` (docs/tenants.md; set
when the server knows tenants from ``--api-keys`` or a trusted proxy's header). A tail request
of tenant V waited (queue, KV, preemption, others' prefill: the *contention* causes) while
other requests were queued or prefilled beside it, from arrival to first token. When one
tenant X that is not V sent most of the prompt tokens of the requests that overlapped those
waits (``MIN_NEIGHBOUR_SHARE``), and V's requests are a fair part of the tail
(``MIN_VICTIM_SHARE``), X's share of that contention moves from the contention causes to
``noisy_neighbour`` (per tail sample, so the shares still add up): the victims' tail is X's
load, not their own. X's own tail stays ``queueing``: a tenant behind its own flood is load.

Only TTFT and E2EL (the metrics that hold a wait for admission) are judged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.analyze.attribution import CauseShare, MetricTail
from tailserve.analyze.data import RunData
from tailserve.analyze.samples import Samples

CAUSE = "noisy_neighbour"
CONTENTION = ("queueing", "kv_cache_pressure", "preemption", "prefill_interference")
# Of the prompt tokens that overlapped the victims' waits.
MIN_NEIGHBOUR_SHARE = 0.6
# Of the tail's samples: tail requests from tenants other than the neighbour.
MIN_VICTIM_SHARE = 0.1
METRICS = ("ttft", "e2el")


def tenants_of(run: RunData) -> list[str | None]:
    return [(q.timing or {}).get("tenant") for q in run.requests]


def name_noisy_neighbour(run: RunData, samples: dict[str, Samples],
                         tails: dict[str, MetricTail]) -> list[str]:
    """Move the neighbour's part of the victims' contention into ``noisy_neighbour`` in each
    judged metric's tail (the findings then name it with its advice); the metrics where it
    was named (none with fewer than two tenants)."""
    tenants = tenants_of(run)
    if len({t for t in tenants if t is not None}) < 2:
        return []
    arrival = np.array([np.nan if q.arrival_t is None else q.arrival_t for q in run.requests])
    first = np.array([np.nan if q.first_token_t is None else q.first_token_t
                      for q in run.requests])
    tokens = np.array([q.prompt_len for q in run.requests], dtype=float)
    labels = np.array([t or "" for t in tenants], dtype=object)
    named = []
    for metric in METRICS:
        mt, s = tails.get(metric), samples.get(metric)
        if mt is None or s is None or not mt.causes or mt.causes[0].cause == "none":
            continue
        found = _neighbour(s.req[mt.tail], labels, arrival, first, tokens)
        if found is None:
            continue
        neighbour, share, victims = found
        if _move(mt, labels[s.req[mt.tail]] != neighbour, share, neighbour, victims, labels,
                 tokens):
            named.append(metric)
    return named


def _neighbour(tail_req: np.ndarray, labels: np.ndarray, arrival: np.ndarray,
               first: np.ndarray, tokens: np.ndarray) -> tuple[str, float, list[str]] | None:
    """(the neighbour, its share of the prompt tokens overlapping its victims' waits, the
    victims' tenants), or None when no tenant's load explains another's tail."""
    overlap: dict[str, dict[str, float]] = {}  # victim request's tenant -> tenant -> tokens
    for i in tail_req:
        if np.isnan(arrival[i]) or np.isnan(first[i]):
            continue
        beside = (arrival < first[i]) & (first > arrival[i])
        beside[i] = False
        by = overlap.setdefault(labels[i], {})
        for tenant in np.unique(labels[beside]):
            by[tenant] = by.get(tenant, 0.0) + float(tokens[beside & (labels == tenant)].sum())
    best: tuple[str, float, list[str]] | None = None
    for cand in {t for by in overlap.values() for t in by}:
        victims = [v for v in overlap if v != cand]
        if sum(labels[tail_req] != cand) < MIN_VICTIM_SHARE * len(tail_req) or not victims:
            continue
        mine = sum(overlap[v].get(cand, 0.0) for v in victims)
        total = sum(sum(overlap[v].values()) for v in victims)
        share = mine / total if total > 0 else 0.0
        if share >= MIN_NEIGHBOUR_SHARE and (best is None or share > best[1]):
            best = (cand, share, sorted(victims))
    return best


def _move(mt: MetricTail, victim: np.ndarray, share: float, neighbour: str,
          victims: list[str], labels: np.ndarray, tokens: np.ndarray) -> bool:
    """Move ``share`` of the contention causes' seconds of the victim samples into the
    neighbour cause; False when there was nothing to move."""
    causes = [c for c in mt.causes if c.share > 0 and c.seconds.sum() > 0]
    if not causes:
        return False
    # Every share is its seconds over the tail's excess: recover that denominator.
    excess = float(causes[0].seconds.sum()) / causes[0].share
    moved = np.zeros(len(mt.tail))
    for c in mt.causes:
        if c.cause in CONTENTION:
            part = np.where(victim, c.seconds * share, 0.0)
            c.seconds = c.seconds - part
            c.share = float(c.seconds.sum()) / excess
            moved += part
    if moved.sum() <= 0:
        return False
    evidence: dict[str, Any] = {
        "tenant": neighbour, "victims": victims,
        "share_of_prompt_tokens_beside_victims": round(share, 3),
        "share_of_all_prompt_tokens": round(
            float(tokens[labels == neighbour].sum()) / max(float(tokens.sum()), 1.0), 3),
        "victim_tail_samples": int(victim.sum()),
    }
    advice = (f"tenant {neighbour!r} sent {share:.0%} of the prompt tokens queued or prefilled "
              f"while {', '.join(repr(v) for v in victims)} waited: give each tenant its own "
              "key with a weight (--api-keys) so the scheduler serves them fair-share, or cap "
              f"{neighbour!r} (max_concurrency, max_requests_per_s in its entry)")
    mt.causes.append(CauseShare(CAUSE, float(moved.sum()) / excess, moved, evidence, advice))
    mt.causes = [c for c in mt.causes if c.share > 0 or c.cause == "none"]
    mt.causes.sort(key=lambda c: -c.share)
    return True
