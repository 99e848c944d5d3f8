"""The phases of ``Scheduler.schedule()``, each taking from one ``StepBudget``:

1. ``schedule_decodes``: every running request that needs exactly one token gets it, in
   admission order, so a decode never waits behind anyone's prefill.
2. ``schedule_prefills``: running partial prefills and waiting requests compete for what is
   left, in the waiting policy's ``prefill_key`` order; a partial prefill gets its next chunk
   (``continue_partial``), a waiting request is admitted (``admit``) when ``max_num_seqs``,
   the KV pool and the watermark allow it. A running request that cannot get a block
   preempts one chosen by the policy (``allocate_running``); no admission follows in that
   step.
3. ``build_output``: what was taken, as a ``SchedulerOutput`` for the runner.

Torch-free, like the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.data.step import BlockedReason, ScheduledRequest, SchedulerOutput
from tailserve.engine.latency import is_decode, time_limited_chunk
from tailserve.engine.step_budget import StepBudget
from tailserve.request import Request, RequestStatus
from tailserve.stepcost import StepShape

if TYPE_CHECKING:
    from tailserve.engine.scheduler import Scheduler


def schedule_decodes(s: Scheduler, b: StepBudget) -> list[Request]:
    """Phase 1; returns the running partial prefills (those left after any preemption)."""
    decodes: list[Request] = []
    partials: list[Request] = []
    for r in s.running:
        (decodes if is_decode(r) else partials).append(r)
    for req in decodes:
        if b.tokens <= 0 or req.status != RequestStatus.RUNNING:
            continue
        if allocate_running(s, b, req, 1):
            b.take_decode(req.request_id, req.num_computed_tokens + 1)
            due = req.next_token_deadline()
            if due is not None:
                slack = due - b.now
                b.min_slack_s = slack if b.min_slack_s is None else min(b.min_slack_s, slack)
    if b.preempted:
        partials = [r for r in partials if r.status == RequestStatus.RUNNING]
        if len(s.waiting):
            b.note(BlockedReason.PREEMPTION)
    return partials


def schedule_prefills(s: Scheduler, b: StepBudget, partials: list[Request]) -> None:
    """Phase 2: partial prefills and admissions in the policy's order."""
    cands = [(s.waiting.prefill_key(r, i, b.now), r) for i, r in enumerate(partials)]
    base = len(cands)
    cands += [(s.waiting.prefill_key(r, base + i, b.now), r) for i, r in enumerate(s.waiting)]
    cands.sort(key=lambda c: c[0])
    # Across tenants, fair share (engine/tenant_share.py); with one, the policy's order.
    s.tenants.sync(r.tenant for _, r in cands)
    b.partial_ids = {r.request_id for r in partials}
    for req in s.tenants.order(cands):
        if req.status == RequestStatus.RUNNING:
            if req.request_id in b.num_new or req not in s.running:
                continue  # preempted (and re-queued) or already served this step
            if not continue_partial(s, b, req):
                break
        elif b.admitting:
            # Once one waiting request is held back, no later one is admitted, but running
            # partial prefills further down still get their chunks: they hold blocks, and
            # only progress frees them.
            admit(s, b, req)
    if b.blocked_by is None and len(s.waiting) and b.tokens <= 0:
        b.blocked_by = BlockedReason.TOKEN_BUDGET


# A long prompt's chunk (the whole prompt alone would not fit the step's target), in a step
# where another prompt completes (a first token), may make that step at most RIDER_SCALE
# times what it was without it (``_time_limited``).
RIDER_SCALE = 2.0


def _time_limited(s: Scheduler, b: StepBudget, req: Request, n: int, start: int) -> int:
    """``n`` prompt tokens of ``req`` (after ``start`` of its prompt) cut so the step's
    predicted time stays within ``b.target_s`` (``latency.time_limited_chunk``: the step's
    first chunk always gets some tokens). Two exceptions:

    - A long prompt's chunk rides behind another prompt's first token in at most as much
      time again as the step had (``RIDER_SCALE``), its last chunk too (its own first token
      is seconds away; one step later costs it little). A 100-token prompt arriving during a
      4,000-token one went first, then the long one's chunk filled the step to the ITL cap:
      the short request's first token waited ~90 ms more (long-mix: the short requests' P99
      TTFT 3.2-3.5x their median before, 2.7-2.9x after; benchmarks/notes/scheduling.md).
      Short prompts ride in full, so a step of many prompts is not cut to the size of one's
      few last tokens.
    - In steps without decodes (nobody's inter-token gap to protect) while one tenant is
      present (``b.shared``: another tenant's prompt would wait for the long step), a short
      prompt (all of it within twice the target alone) whose rest completes and keeps the
      step within twice the target goes whole. Otherwise a short prompt behind a long one
      that goes first (an aged place) got what the long chunk left, 8-32 tokens a step, and
      took 4-8 steps to its first token instead of one; a prompt arriving meanwhile waits
      at most 2x the cap. A long prompt's last chunk keeps to the cap: it is what an
      arrival waits for.

    A prompt that would miss its TTFT SLO even alone is served best effort:
    it does not ride behind another prompt's first token at all. With 4,000-token prompts
    among 100-token ones (the server's 1 s SLO: every long one best effort) the short
    ones' P99 first token was 2.7-3.2x their median with the ride, the short step doubled
    by it (benchmarks/notes/scheduling.md)."""
    target = b.target_s
    if target is None:
        return n
    shape = b.shape
    model = s.step_model
    completes = start + n >= req.num_tokens
    whole: float | None = None

    def alone_whole() -> float:  # ``idle_prefill_s``, predicted at most once a call
        nonlocal whole
        if whole is None:
            whole = s.idle_prefill_s(req)
        return whole

    if b.completing_tenants and shape.prefill_tokens and alone_whole() > target:
        best_effort = req.slo.ttft_s is not None and alone_whole() > req.slo.ttft_s
        target = min(target, (1.0 if best_effort else RIDER_SCALE) * model.predict(shape))
    fit = time_limited_chunk(model, shape, start, n, target, not shape.prefill_tokens)
    if (fit < n and completes and not shape.decode_seqs and not b.shared
            and model.predict(shape.plus_chunk(start, n)) <= 2 * target
            and alone_whole() <= 2 * target):
        return n
    return fit


def _num_new_tokens(s: Scheduler, req: Request, budget: int) -> int:
    n = req.num_tokens - req.num_computed_tokens
    threshold = s.config.long_prefill_token_threshold
    if threshold is not None:
        n = min(n, threshold)
    return min(n, budget)


def _rides_behind(s: Scheduler, b: StepBudget, req: Request, completes: bool) -> bool:
    """Across tenants, a chunk that completes no prompt does not ride in a step that
    completes another tenant's: it would give its own user nothing in this step and delay
    theirs (a flood's 32-token filler made a quiet tenant's 64-token step 85 ms instead of
    ~45 here). The fair order still decides who goes first, so a flood whose turn it is
    leads its step and is not starved."""
    return (s.tenants.competing and not completes
            and any(t != req.tenant for t in b.completing_tenants))


def continue_partial(s: Scheduler, b: StepBudget, req: Request) -> bool:
    """The next chunk of a running partial prefill; False when the step is full."""
    start = req.num_computed_tokens
    n = _num_new_tokens(s, req, b.tokens)
    n = _time_limited(s, b, req, n, start)
    if n <= 0:
        b.note(BlockedReason.TOKEN_BUDGET if b.tokens <= 0 else BlockedReason.STEP_TIME)
        return False
    completes = start + n >= req.num_tokens
    if _rides_behind(s, b, req, completes):
        return True
    if allocate_running(s, b, req, n):
        b.take_chunk(req.request_id, start, n)
        s.tenants.charge(req, n)
        if completes:
            b.partial_ids.discard(req.request_id)
            b.completing_tenants.add(req.tenant)
    return True


def admit(s: Scheduler, b: StepBudget, req: Request) -> None:
    """Admit a waiting (or preempted) request with its first chunk, if everything allows."""
    cfg = s.config
    if b.preempted:
        b.stop_admitting(BlockedReason.PREEMPTION, overwrite=False)
        return
    if b.tokens <= 0:
        b.stop_admitting(BlockedReason.TOKEN_BUDGET)
        return
    if len(s.running) >= cfg.max_num_seqs:
        b.stop_admitting(BlockedReason.MAX_NUM_SEQS)
        return
    hits, num_hit_tokens = s.kv.get_computed_blocks(req)
    remaining = req.num_tokens - num_hit_tokens
    n = remaining
    if cfg.long_prefill_token_threshold is not None:
        n = min(n, cfg.long_prefill_token_threshold)
    if not cfg.enable_chunked_prefill and n > b.tokens:
        b.stop_admitting(BlockedReason.TOKEN_BUDGET)
        return
    n = min(n, b.tokens)
    if b.target_s is not None:
        n = _time_limited(s, b, req, n, num_hit_tokens)
        if n <= 0:
            b.stop_admitting(BlockedReason.STEP_TIME)
            return
    if _rides_behind(s, b, req, n >= remaining):
        b.note(BlockedReason.TENANT_SHARE)
        return
    if n < remaining and s.partials_full(req, b.partial_ids):
        # It would be left part-way: others may still finish theirs in this step.
        b.note(BlockedReason.PARTIAL_PREFILLS)
        return
    reserve = None
    if cfg.admission_policy == "reserve":
        reserve = req.num_prompt_tokens + req.max_tokens
    if s.tenants.competing and s.tenants.kv_over_share(
            s, req, s.kv.blocks_for(reserve or num_hit_tokens + n)):
        # Past its tenant's share of the pool while another tenant waits: the others
        # (later in the order) may still be admitted.
        b.note(BlockedReason.TENANT_SHARE)
        return
    if not s.kv.allocate_slots(req, n, hits, apply_watermark=True, reserve_up_to=reserve):
        b.stop_admitting(BlockedReason.KV_CACHE)
        return
    s.waiting.remove(req)
    s.kv.record_prefix_query(req.num_tokens, num_hit_tokens)
    if req.status == RequestStatus.PREEMPTED:
        req.timestamps.resumed.append(b.now)
    elif req.timestamps.first_scheduled is None:
        req.timestamps.first_scheduled = b.now
        req.num_cached_tokens = num_hit_tokens
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = num_hit_tokens
    req.admit_seq = s.next_admit_seq()
    s.running.append(req)
    b.take_chunk(req.request_id, num_hit_tokens, n)
    s.tenants.charge(req, n)
    if n < remaining:
        b.partial_ids.add(req.request_id)
    else:
        b.completing_tenants.add(req.tenant)


def allocate_running(s: Scheduler, b: StepBudget, req: Request, n: int) -> bool:
    """Blocks for ``n`` more tokens of a running request, preempting the policy's victim
    among those not yet scheduled this step until they fit; False when ``req`` itself was
    the one."""
    while not s.kv.allocate_slots(req, n):
        candidates = [r for r in s.running if r.request_id not in b.num_new]
        victim = s.waiting.victim(candidates, b.now)
        s.preempt(victim, b.now)
        b.preempted.append(victim.request_id)
        if victim is req:
            return False
    return True


def build_output(s: Scheduler, b: StepBudget, finished: list[str]) -> SchedulerOutput:
    """Phase 3: the step for the runner, in running order."""
    scheduled = []
    num_prefill_tokens = 0
    num_decode_seqs = 0
    for req in s.running:
        n = b.num_new.get(req.request_id, 0)
        if n == 0:
            continue
        start = req.num_computed_tokens
        is_prefill = not (n == 1 and start == req.num_tokens - 1 and req.num_output_tokens)
        if is_prefill:
            num_prefill_tokens += n
        else:
            num_decode_seqs += 1
        scheduled.append(
            ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.all_token_ids[start : start + n],
                num_computed_tokens=start,
                block_ids=s.kv.block_ids(req.request_id),
                group_block_ids=s.kv.group_block_ids(req.request_id) if s.kv.grouped else (),
                sample=start + n == req.num_tokens,
                is_prefill=is_prefill,
                sampling_params=req.sampling_params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                eos_token_ids=req.eos_token_ids,
            )
        )
    shape: StepShape = b.shape
    return SchedulerOutput(
        scheduled=scheduled,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_seqs=num_decode_seqs,
        preempted_request_ids=b.preempted,
        finished_request_ids=finished,
        admission_blocked_by=b.blocked_by,
        num_decode_context_tokens=shape.decode_context_tokens,
        prefill_attention_pairs=shape.prefill_attention_pairs,
        predicted_s=s.step_model.predict(shape) if scheduled else None,
        kv_events=s.kv.take_events(),
    )
