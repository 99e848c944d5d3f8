"""How long a step may take: the time target the scheduler sizes its prefill chunks to
(``step_time_target``), from the decodes' slack under their ITL SLO, the cap on a step with
no decode (``prefill_step_cap``), the overdue queue that lifts both (``queue_overdue``) and,
while more than one tenant is present, the shared cap (``shared_step_cap``). Functions of
the scheduler's state; torch-free."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tailserve.engine.latency import is_decode, step_time_budget
from tailserve.engine.step_budget import StepBudget
from tailserve.engine.waiting_queue import late_yield_s
from tailserve.request import Request, RequestStatus
from tailserve.stepcost import StepShape

if TYPE_CHECKING:
    from tailserve.engine.scheduler import Scheduler

# While more than one tenant is present a step takes at most SHARED_STEP_SCALE times the
# predicted step of a SHARED_STEP_TOKENS-token prompt alone (``shared_step_cap``).
SHARED_STEP_TOKENS = 32
SHARED_STEP_SCALE = 2.0
# A step with no decode may take at least FIXED_COST_MULTIPLE times the step-time model's fixed
# cost (its ``base``: the weights streamed once a step, the host's work), so cutting a lone
# prompt into chunks repeats that cost for at most ~1/10 of its prefill (``prefill_step_cap``).
FIXED_COST_MULTIPLE = 10.0
# A step without decodes may also take as long as keeps the arrivals expected while it runs
# (``ArrivalWatch.rate`` x its time) under ARRIVAL_RISK: where nobody arrives while the engine
# works, a lone prompt goes in whole-budget steps (``prefill_step_cap``). At 0.05 the estimate
# of a 0.5 req/s Poisson load sat near the line (0.05 / 0.5 = 0.1 s, the ITL cap's size) and
# its dips let long steps through: the long-mix shorts' P99 came 2.33-2.97x their median
# against 2.05-2.66x before (benchmarks/notes/scheduling.md); at 0.02 the line is 0.2 req/s.
ARRIVAL_RISK = 0.02


def prefill_step_cap(s: Scheduler) -> float | None:
    """The time a step with no decode may take (``prefill_step_cap_by`` without its why)."""
    return prefill_step_cap_by(s)[0]


def prefill_step_cap_by(s: Scheduler) -> tuple[float | None, str | None]:
    """The time a step with no decode may take, and what set it: ``itl_slo``,
    ``fixed_cost``, ``token_budget`` or ``arrivals``. The tightest ITL SLO among the running
    requests and the server's (less the margin), never more than a chunk of the whole
    token budget at a prompt's start is predicted to take. It is what a decode would allow
    right after its token, and what a prompt that arrives meanwhile waits for: late
    chunks of a long prompt read its whole context in attention, and a 512-token chunk
    3,000 tokens in took 0.5-1.5 s here, so a short prompt arriving meanwhile waited for
    all of it. Capped, such a chunk is cut to fewer tokens at about the same cost per
    token. Never below ``FIXED_COST_MULTIPLE`` times the step's fixed cost, though: on a
    model whose every step streams its weights, the ITL SLO alone cut a lone prompt into
    16-token steps that cost mostly that (Llama-3.2-1B shape, Q4_0, 2 cores: 65 ms a
    16-token step, a 2,000-token prompt in 124 steps and 9.9 s, 6.6 s in 512-token ones).
    And never below the step in which ARRIVAL_RISK arrivals are expected, by the rate of
    arrivals that found the engine busy lately (``engine/arrival_watch.py``), whole budget
    or not: the cap protects arrivals, and where none come (a closed-loop client, one
    user) it only cut the prompt (a lone 2,000-token prompt on the bundled model: 1,120 ms
    in ~100 ms steps, 890 in whole-budget ones). Under Poisson arrivals at 0.5/s that step
    is 40 ms, under the ITL cap. None when steps are not sized by time (no ITL SLO, or no
    chunking)."""
    cfg = s.config
    itl = [r.slo.itl_s for r in s.running if r.slo.itl_s is not None]
    if cfg.slo_itl_s is not None:
        itl.append(cfg.slo_itl_s)
    if not (itl and cfg.enable_chunked_prefill):
        return None, None
    model = s.step_model
    whole = model.predict(StepShape().plus_chunk(0, cfg.max_num_batched_tokens))
    floor = FIXED_COST_MULTIPLE * model.predict(StepShape())
    slo = step_time_budget(model, min(itl))
    cap, by = (slo, "itl_slo") if slo >= floor else (floor, "fixed_cost")
    if whole < cap:
        cap, by = whole, "token_budget"
    quiet = ARRIVAL_RISK / s.arrivals.rate(s.now())
    return (quiet, "arrivals") if quiet > cap else (cap, by)


def step_time_target(s: Scheduler, b: StepBudget) -> float | None:
    """The time the step may take, given the decodes it carries (``b.shape`` holds only
    them yet): their smallest slack less the margin (``latency.step_time_budget``);
    without decodes, ``prefill_step_cap``; neither while the queue is overdue. Only when
    prompts may be split (without chunking a prompt is prefilled whole or not at all).
    While more than one tenant is present, never more than ``shared_step_cap``."""
    budget = _slo_target(s, b)
    if b.shared and s.config.enable_chunked_prefill:
        cap = shared_step_cap(s)
        budget = cap if budget is None else min(budget, cap)
    return budget


def shared_step_cap(s: Scheduler) -> float:
    """The time a step may take while more than one tenant is present: twice a
    ``SHARED_STEP_TOKENS``-token prompt's own step (by the step-time model, so it
    scales with the model and the machine). A tenant's short prompt that arrives
    meanwhile waits for the step in flight, then for its own: 89 ms steps (the ITL cap)
    left a quiet tenant's P99 first token 1.8x its value with no flood; with ~50 ms ones it
    was within 1.5x, and the flood prefilled 851 tokens/s against 973 with whole-budget
    steps (the attention of late chunks dominates them, not the per-step cost)."""
    return SHARED_STEP_SCALE * s.step_model.predict(
        StepShape().plus_chunk(0, SHARED_STEP_TOKENS))


def _slo_target(s: Scheduler, b: StepBudget) -> float | None:
    if b.shape.decode_seqs:
        s.min_decode_slack_s = b.min_slack_s
    if not s.config.enable_chunked_prefill:
        return None
    if queue_overdue(s, b.now, b.present):
        return None  # the queue goes first
    if b.shape.decode_seqs:
        if b.min_slack_s is None:
            return None  # no decode holds an ITL SLO
        s.itl_target_s = step_time_budget(s.step_model, b.min_slack_s)
        return s.itl_target_s
    return prefill_step_cap(s)


def present_tenants(s: Scheduler, now: float) -> set[str | None]:
    """The tenants present at ``now``: a request running or waiting, or a recent arrival
    (``TenantShares.present``)."""
    return s.tenants.present(itertools.chain(s.running, s.waiting), now)


def queue_overdue(s: Scheduler, now: float, present: set[str | None] | None = None) -> bool:
    """A request still waiting for its first token (queued or part-way through its
    prompt) is past its TTFT deadline though its whole prompt alone would fit its SLO:
    the queue, not its size, made it late. Then neither the decodes' slack nor the ITL
    cap sizes the step: prefill takes the whole token budget, and an overloaded engine
    serves its queue. Held to the ITL, a loaded host (steps 3-5x slower beside other
    processes) admitted 5 requests at a time where the token budget admits 29, and first
    tokens waited 24 s instead of 11 at the median (the mixed load at 0.5 req/s). So
    does a request never scheduled by its starvation bound. Preempted requests do not
    count: taking the whole budget for them would only preempt again. Nor does one tenant's
    overdue queue while another tenant is present (``present``, the step's if given)."""
    pending = [r for r in s.running if not is_decode(r)] + list(s.waiting)
    late = {r.tenant for r in pending if _overdue(s, r, now)}
    if not late:
        return False
    # Across tenants, only while no other tenant is present (engine/tenant_share.py).
    return not (present_tenants(s, now) if present is None else present) - late


def _overdue(s: Scheduler, r: Request, now: float) -> bool:
    slo = r.slo.ttft_s
    if slo is None or r.num_output_tokens or r.status == RequestStatus.PREEMPTED:
        return False
    waited = now - r.arrival_time
    idle = s.idle_prefill_s(r)
    # Past its starvation bound unscheduled (DeadlineQueue.starvation_bound: its SLO,
    # then the larger of its SLO and its own prefill): late by its own size or not, it
    # has had its best-effort window (on a host 4x slower than usual every 500-token
    # prompt is "too long" for a 1 s SLO, and the queue would never drain).
    if r.timestamps.first_scheduled is None and waited > slo + late_yield_s(r, idle):
        return True
    return waited > slo and idle <= slo
