"""Tenants as a scheduling unit: each tenant's fair share of the prefill budget, the KV pool
and the waiting queue, by its weight (``Request.tenant`` / ``tenant_weight``, from the API
key's entry in ``--api-keys``).

- **Prefill order**: weighted fair queuing over prefill tokens, composed with the waiting
  policy (``engine/waiting_queue.py``): within a tenant the policy's ``prefill_key`` order
  (EDF by default); across tenants the lowest *finish tag* first, a request's tag being its
  tenant's normalized service (prefill tokens served / weight) plus the remaining prompt
  tokens of itself and its tenant's candidates before it, over the weight. A flood of long
  prompts from one tenant then delays another tenant's short prompt by about one step, not
  by the flood; with weights 3:1 two backlogged tenants get prefill tokens 3:1.
- **KV pool**: while another tenant waits, a tenant that already holds blocks is not
  admitted beyond its weighted share of the pool (beyond the watermark); it keeps what it
  holds (no preemption for share), and the blocks its requests free go to the waiting one.
- **Step length**: a prompt that arrives waits for the step in flight. While more than one
  tenant is present (``present``: a request in the engine, or an arrival within
  ``TENANT_PRESENCE_S``), steps stay within the shared cap (``step_time.shared_step_cap``,
  ~50 ms here), one tenant's overdue queue does not lift the time cap
  (``step_time.queue_overdue``), and no prompt's rest takes a step past the cap; under a
  flood of 2,000-token prompts whole-budget steps took 0.5-0.8 s each. A chunk that
  completes no prompt stays out of a step that completes another tenant's
  (``step_phases``).
- **Queue bound**: when ``max_queue_len`` is reached, a tenant within its weighted share of
  the queue is still queued, and the one over its share is refused (``queue_full``, naming
  the share), so a flood sheds the flooder, not its neighbours.

With one tenant (no keys file, or every request from the same one) each of these is the
policy alone: the schedule is exactly the single-tenant one. Service is kept only for the
tenants with prefill work pending and relative to the least of them, so a tenant that goes
idle banks no credit and the table stays as small as the backlog. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tailserve.request import Request

if TYPE_CHECKING:
    from tailserve.engine.scheduler import Scheduler

Keyed = tuple[tuple[float, ...], Request]
# How long after its last arrival a tenant counts as present with nothing in the engine. A
# tenant at 0.5 req/s leaves a gap this long once in ~20,000 arrivals; the cost to another
# tenant's flood meanwhile is shorter steps (~12% of its prefill rate here).
TENANT_PRESENCE_S = 30.0


def tenant_label(tenant: str | None) -> str:
    """The name errors use for a request's tenant (None is the default tenant)."""
    return "default" if tenant is None else tenant


class TenantShares:
    def __init__(self) -> None:
        # Normalized prefill service (tokens / weight) of each tenant with prefill pending,
        # relative to the least of them (so 0 for that one).
        self._served: dict[str | None, float] = {}
        # More than one tenant has prefill pending in this step (``sync``).
        self.competing = False
        # Each tenant's latest arrival (``arrived``), kept for ``TENANT_PRESENCE_S``.
        self._last_arrival: dict[str | None, float] = {}

    def arrived(self, tenant: str | None, now: float) -> None:
        """A request of ``tenant`` was queued at ``now``."""
        self._last_arrival[tenant] = now
        if len(self._last_arrival) > 1:
            gone = [t for t, at in self._last_arrival.items() if now - at > TENANT_PRESENCE_S]
            for t in gone:
                del self._last_arrival[t]

    def present(self, in_engine: Iterable[Request], now: float) -> set[str | None]:
        """The tenants with a request in the engine (``in_engine``) or an arrival within
        ``TENANT_PRESENCE_S`` of ``now``."""
        recent = {t for t, at in self._last_arrival.items() if now - at <= TENANT_PRESENCE_S}
        return recent | {r.tenant for r in in_engine}

    def sync(self, tenants: Iterable[str | None]) -> bool:
        """Start a step whose prefill candidates belong to ``tenants``: forget the others,
        start a newcomer at the least service among those pending (0); True when more
        than one tenant competes."""
        pending = set(tenants)
        kept = {t: v for t, v in self._served.items() if t in pending}
        floor = min(kept.values(), default=0.0)
        self._served = {t: kept.get(t, floor) - floor for t in pending}
        self.competing = len(pending) > 1
        return self.competing

    def charge(self, req: Request, num_tokens: int) -> None:
        """``num_tokens`` prompt tokens of ``req`` were scheduled."""
        self._served[req.tenant] = (self._served.get(req.tenant, 0.0)
                                    + num_tokens / req.tenant_weight)

    def order(self, cands: Sequence[Keyed]) -> list[Request]:
        """The candidates (sorted by the policy's key) in the order the prefill budget serves
        them; with one tenant among them, as given."""
        if len({r.tenant for _, r in cands}) <= 1:
            return [r for _, r in cands]
        floor = min(self._served.values(), default=0.0)
        remaining: dict[str | None, float] = {}
        tagged = []
        for key, r in cands:
            work = remaining.get(r.tenant, 0.0) + (r.num_tokens - r.num_computed_tokens)
            remaining[r.tenant] = work
            tag = self._served.get(r.tenant, floor) + work / r.tenant_weight
            tagged.append((tag, key, r))
        tagged.sort(key=lambda x: (x[0], x[1]))
        return [r for _, _, r in tagged]

    def kv_over_share(self, s: Scheduler, req: Request, need_blocks: int) -> str | None:
        """Why ``req`` must wait: holding ``need_blocks`` after its first chunk would take its
        tenant, which already holds blocks, past its weighted share of the pool while
        another tenant waits; None when it may be admitted. A tenant holding nothing may
        always start one request, however long (else a prompt above its share would wait
        for ever)."""
        if not self.competing:
            return None
        waiting = list(s.waiting)
        if all(r.tenant == req.tenant for r in waiting):
            return None
        weights = _weights([*s.running, *waiting, req])
        held = sum(s.kv.num_blocks_held(r.request_id)
                   for r in s.running if r.tenant == req.tenant)
        if held == 0:
            return None
        pool = s.cache_config.num_kv_blocks - s.kv.watermark_blocks
        share = pool * weights[req.tenant] / sum(weights.values())
        if held + need_blocks <= share:
            return None
        return (f"tenant {tenant_label(req.tenant)!r} holds {held} KV blocks and would hold "
                f"{held + need_blocks}, over its share {share:.0f} of {pool}")


def _weights(reqs: Iterable[Request]) -> dict[str | None, float]:
    """Each tenant's weight (its latest request's)."""
    return {r.tenant: r.tenant_weight for r in reqs}


def queue_share(s: Scheduler, req: Request, limit: int) -> tuple[int, int, str] | None:
    """When other tenants have requests in the engine: (the tenant's waiting requests, the
    places of the queue its weight gives it, at least one; a sentence naming them); None
    with one tenant."""
    waiting = list(s.waiting)
    weights = _weights([*s.running, *waiting])
    if all(t == req.tenant for t in weights):
        return None
    weights[req.tenant] = req.tenant_weight
    total = sum(weights.values())
    places = max(1, math.floor(limit * req.tenant_weight / total))
    mine = sum(r.tenant == req.tenant for r in waiting)
    why = (f"tenant {tenant_label(req.tenant)!r} is over its share of the waiting queue "
           f"({mine} waiting; weight {req.tenant_weight:g} of {total:g} gives it {places} of "
           f"max_queue_len {limit})")
    return mine, places, why
