"""Scheduler: continuous batching under a token budget and a step-time budget, chunked prefill
in SRPT order with aging, preemption.

The algorithm of one ``schedule()`` call, with ``budget = max_num_batched_tokens``:

1. **Running decodes first.** Every running request that needs exactly one token (a decode)
   gets it, in admission order, so a decode never waits behind anyone's prefill.
2. **Prefill by time.** Running partial prefills and waiting requests compete for what is
   left, in ``_prefill_key`` order: the earliest place ``arrival + remaining x aging``
   (``srpt``: shortest remaining prefill first, and no request that arrives after a prompt's
   place ever passes it), or arrival order (``fcfs``); priority first under ``priority``.
   While decodes run (and prompts may be chunked), each chunk is the largest multiple of
   ``PREFILL_ALIGN`` (32), else 16 or 8 tokens, that keeps the step's predicted time
   (``stepcost.StepTimeModel``) within the step's ITL target: ``--itl-target-ms`` when
   given, else ``itl_target_factor`` (1.5) x the predicted decode-only step of the decodes this
   step carries (``latency.step_target_s``), so prefill gets about a third of every step
   whatever the concurrency and a step is at most ~1.5x a decode-only one. The step's first
   chunk always gets tokens, so prefill progresses: ``MIN_PREFILL_CHUNK`` (8) when even that
   is over the target, ``PREFILL_ALIGN`` when the decodes alone fill a fixed target
   (``latency.time_limited_chunk``). While a request has waited ``itl_target_max_wait_s``
   (2 s) unscheduled, the target yields and prefill takes the whole token budget: an
   overloaded engine serves its queue. With no decode running prefill takes up to the whole
   token budget, in steps no longer than ``prefill_step_cap`` (8 one-decode steps, at most
   a budget-sized chunk at a prompt's start): a prompt arriving meanwhile waits for one
   such step at most, and a long prompt's late chunks, whose attention reads its whole
   context, are cut to fit (a prompt that completes in the step may take it to twice the
   cap). At most ``max_num_partial_prefills`` requests are left part-way through their
   prompt, and of those at most ``max_long_partial_prefills`` longer than the token
   budget, so a short prompt starts beside a long one instead of queueing behind it; a
   prompt that finishes in the step always goes.
3. When a running request cannot get a block, the newest admission not yet scheduled this
   step (by priority first under ``priority``) is **preempted by recompute**: its blocks are
   freed, it keeps its output tokens and goes back to the queue, and its next prefill
   recomputes prompt + outputs, so its answer does not change. No admission follows in
   that step.
4. **Admission** of a waiting request needs ``max_num_seqs``, the KV pool and the watermark
   to allow it. ``optimistic`` admits on the first chunk's blocks; ``reserve`` allocates
   blocks for prompt + max_tokens up front and therefore never preempts. With
   ``ttft_slo_s``, ``add_request`` refuses a request whose predicted TTFT is over it
   (``engine/latency.py``).

``update_from_output`` applies the sampled tokens, stamps timestamps, decides who stops and
feeds the measured step time to the step-time model. Torch-free: tests drive it with a fake
runner and a fake clock and assert exact block ids and chunk sizes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from tailserve.config import (
    AUTO_PREFILL_STEP_DECODES,
    CacheConfig,
    SchedulerConfig,
    check_pool_fits,
    max_request_tokens,
)
from tailserve.data.records import SchedulerSnapshot
from tailserve.data.step import EngineOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from tailserve.engine.latency import (
    MIN_PREFILL_CHUNK,
    PREFILL_ALIGN,
    check_slo,
    decode_shape,
    is_decode,
    predict_ttft,
    step_target_s,
    time_limited_chunk,
)
from tailserve.engine.waiting_queue import WaitingQueue
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.kv.manager import KVCacheManager, cdiv
from tailserve.request import Request, RequestStatus, SequenceLimits, check_request_lengths
from tailserve.stepcost import StepShape, StepTimeModel

__all__ = ["MIN_PREFILL_CHUNK", "PREFILL_ALIGN", "Scheduler", "WaitingQueue"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_pool_fits(config, cache)
        self.config = config
        self._clock = clock
        # Learned online from every step (update_from_output); the engine seeds it with a
        # calibration at start-up.
        self.step_model = StepTimeModel()
        # The ITL target of the last step that carried decodes (fixed when --itl-target-ms
        # was given, else re-derived for every step's decodes: step_target_s); None when
        # steps are not sized by time.
        self.itl_target_s: float | None = config.itl_target_s if config.enable_itl_target \
            else None
        self.cache_config = cache
        self._lengths = SequenceLimits(
            config.max_model_len, cache.block_size, cache.num_kv_blocks,
            max_request_tokens(config, cache),
        )
        self.kv = KVCacheManager(
            cache.num_kv_blocks,
            cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            watermark=cache.watermark,
            enable_kv_cache_events=cache.enable_kv_cache_events,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._admit_counter = itertools.count()
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0

    # ---------------------------------------------------------------- requests in and out
    def validate(self, req: Request) -> None:
        """Reject what can never be served, with the numbers; resolves ``max_tokens=None``
        into ``req.max_tokens`` (the caller's ``SamplingParams`` stay as they were given)."""
        req.max_tokens = check_request_lengths(
            self._lengths, req.num_prompt_tokens, req.sampling_params.max_tokens
        )
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use")
        self._check_admissible(req)

    def _check_admissible(self, req: Request) -> None:
        """Admission must leave the watermark free: a request whose admission needs more
        blocks than the pool holds beyond it would wait forever (and, at the head of the
        queue, hold everyone behind it)."""
        cfg = self.config
        tokens = req.num_prompt_tokens
        if cfg.admission_policy == "reserve":
            tokens += req.max_tokens
        elif cfg.enable_chunked_prefill:
            tokens = min(tokens, cfg.max_num_batched_tokens,
                         cfg.long_prefill_token_threshold or tokens)
        need = cdiv(tokens, self.cache_config.block_size)
        room = self.cache_config.num_kv_blocks - self.kv.watermark_blocks
        if need > room:
            raise InvalidRequestError(
                f"admitting this request needs {need} KV blocks ({tokens} tokens) but the "
                f"pool holds {room} beyond the watermark ({self.cache_config.num_kv_blocks} "
                f"blocks, watermark {self.kv.watermark_blocks})", param="max_tokens",
            )

    def add_request(self, req: Request) -> None:
        self.validate(req)
        limit = self.config.max_queue_len
        if limit is not None:
            # Waiting requests that free max_num_seqs slots will start at the next step are not
            # queued: a burst that lands between two steps must not be refused while slots are
            # free (and max_queue_len 0 must still run max_num_seqs at once). The engine's
            # bound is max_num_seqs + max_queue_len in all, the same as the API's admission.
            free_slots = max(0, self.config.max_num_seqs - len(self.running))
            queued = len(self.waiting) - free_slots
            if queued >= limit:
                raise QueueFullError(
                    f"the waiting queue is full ({queued} of {limit} waiting, "
                    f"{len(self.running)} of {self.config.max_num_seqs} running)"
                )
        if self.config.ttft_slo_s is not None:
            self._check_slo(req, self.config.ttft_slo_s)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)

    # ---------------------------------------------------------------- predicted latency
    def predict_ttft(self, req: Request) -> tuple[float, float]:
        """(predicted TTFT now, on an idle engine) of a request not yet queued: the prefill
        of every request the budget serves before it (``_prefill_key`` order) plus its own."""
        mine = self._prefill_key(req, len(self.running) + len(self.waiting))
        pending = [r for r in self.running if not is_decode(r)]
        pending += list(self.waiting)
        ahead = [r for i, r in enumerate(pending) if self._prefill_key(r, i) <= mine]
        decode = decode_shape(self.running)
        target = self.step_target(decode) if decode.decode_seqs else None
        return predict_ttft(self.step_model, self.config.max_num_batched_tokens, target,
                            self.running, ahead, req, self.prefill_step_cap())

    def step_target(self, decode: StepShape) -> float | None:
        """The ITL target of a step carrying ``decode`` (None: steps are not sized by time)."""
        cfg = self.config
        if not (cfg.enable_itl_target and cfg.enable_chunked_prefill):
            return None
        return step_target_s(self.step_model, decode, cfg.itl_target_s, cfg.itl_target_factor)

    def _queue_overdue(self, now: float) -> bool:
        """A request has waited ``itl_target_max_wait_s`` without ever being scheduled: the
        ITL target yields for this step. Held to it, a full queue starves: with 32 requests
        in flight, each prompt got 8-16 tokens a step beside the two or three decodes the
        target was protecting, so the batch never grew (166 output tok/s, first tokens after
        11 s; benchmarks/notes/scheduling.md). Preempted requests do not count: they were admitted
        once, and taking the whole budget for them would only preempt again."""
        limit = self.config.itl_target_max_wait_s
        return any(r.timestamps.first_scheduled is None and now - r.arrival_time > limit
                   for r in self.waiting)

    def prefill_step_cap(self) -> float | None:
        """The time a step with no decode may take: ``prefill_step_target_s`` when given,
        else AUTO_PREFILL_STEP_DECODES x the predicted one-decode step; never more than a
        chunk of the whole token budget at a prompt's start is predicted to take. A prompt
        that arrives while others prefill waits for the step in flight: late chunks of a
        long prompt read its whole context in attention, and a 512-token chunk 3,000 tokens
        in took 0.5-1.5 s here, so a short prompt arriving meanwhile waited for all of it
        and then shared its own step with the next one (the long-mix workload's short
        requests: P99 TTFT 20-100x their median). Capped, such a chunk is cut to fewer
        tokens: the same cost per token (a 128-token chunk's prefill costs per token what a
        512-token one's does), and the prompt's own prefill loses only the extra steps'
        fixed time. None when steps are not sized by time."""
        cfg = self.config
        if not (cfg.enable_itl_target and cfg.enable_chunked_prefill):
            return None
        whole = self.step_model.predict(StepShape().plus_chunk(0, cfg.max_num_batched_tokens))
        target = cfg.prefill_step_target_s
        if target is None:
            target = AUTO_PREFILL_STEP_DECODES * self.step_model.predict(
                StepShape().plus_decode(1))
        return min(whole, target)

    def _is_long(self, req: Request) -> bool:
        """A prompt that counts against ``max_long_partial_prefills``: longer than one step
        may take of it (``long_prefill_token_threshold``, else the token budget)."""
        cfg = self.config
        return req.num_tokens > (cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens)

    def _partials_full(self, req: Request, partial_ids: set[str]) -> bool:
        """Leaving ``req`` part-way would pass ``max_num_partial_prefills``, or, for a long
        prompt, ``max_long_partial_prefills`` (``partial_ids``: those left part-way now)."""
        cfg = self.config
        if len(partial_ids) >= cfg.max_num_partial_prefills:
            return True
        return self._is_long(req) and sum(
            self._is_long(self.requests[i]) for i in partial_ids) >= cfg.max_long_partial_prefills

    def _check_slo(self, req: Request, slo_s: float) -> None:
        predicted, idle = self.predict_ttft(req)
        check_slo(req, slo_s, predicted, idle, len(self.waiting), len(self.running))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside (client gone, stop string matched)."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        req.timestamps.finished = self._clock()
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def snapshot(self) -> SchedulerSnapshot:
        """Queue lengths, preemptions, the block manager's counters and the step-time model
        (its ``describe``: well under a microsecond), as a frozen value."""
        return SchedulerSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions_total=self.num_preemptions_total,
            kv=self.kv.snapshot(),
            itl_target_s=self.itl_target_s,
            step_model=self.step_model.describe(),
        )

    # ---------------------------------------------------------------- schedule
    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None:
            n = min(n, threshold)
        return min(n, budget)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.admit_seq))
        return max(candidates, key=lambda r: r.admit_seq)

    def _preempt(self, req: Request, now: float) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.timestamps.preempted.append(now)
        self.num_preemptions_total += 1
        self.waiting.push(req, front=True)

    def _prefill_key(self, req: Request, index: int) -> tuple[float, ...]:
        """Order of the prefill budget. ``srpt``: the earliest *place* ``arrival + served +
        remaining x aging`` (shortest remaining prefill first among requests that arrived
        together; a request is never passed by one that arrived after its place, whose key
        is at least its arrival + one token's aging: that bounds its wait). ``served`` is
        the time of the steps that carried its prompt: a request ages while it waits, not
        while it is being prefilled. Without it a long prompt part-way through its prefill
        had "waited" its own prefill time, its place came before any new arrival's, and a
        100-token prompt arriving in the last ~20% of a 4,000-token one waited for all of
        it (long-mix). A request that gets no tokens keeps its place, so the bound holds.
        ``fcfs``: running first, then queue order.
        Under ``priority`` the priority value leads either way."""
        cfg = self.config
        lead = float(req.priority) if cfg.scheduling_policy == "priority" else 0.0
        if cfg.prefill_scheduling == "fcfs":
            return (lead, float(index))
        remaining = req.num_tokens - req.num_computed_tokens
        place = (req.arrival_time + req.timestamps.prefill_time
                 + remaining * cfg.prefill_aging_s_per_token)
        return (lead, place, float(index))

    def _time_limited(self, n: int, shape: StepShape, start: int, first_chunk: bool,
                      target: float, completes: bool) -> int:
        """``n`` cut so the step's predicted time stays within ``target``
        (``latency.time_limited_chunk``: the step's first chunk always gets some tokens).
        One exception, in steps without decodes (nobody's inter-token gap to protect): a
        prompt whose rest (``completes``) keeps the step within twice ``target`` goes whole.
        Otherwise a short prompt behind a long one that goes first (an aged place) got what
        the long chunk left, 8-32 tokens a step, and took 4-8 steps to its first token
        instead of one; a prompt arriving meanwhile waits at most 2x the cap."""
        fit = time_limited_chunk(self.step_model, shape, start, n, target, first_chunk)
        if (fit < n and completes and not shape.decode_seqs
                and self.step_model.predict(shape.plus_chunk(start, n)) <= 2 * target):
            return n
        return fit

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self._clock()
        budget = cfg.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted: list[str] = []

        decodes: list[Request] = []
        partials: list[Request] = []
        for r in self.running:
            (decodes if is_decode(r) else partials).append(r)
        decode_seqs = decode_context = 0  # the decodes' part of the step's shape
        for req in decodes:
            if budget <= 0 or req.status != RequestStatus.RUNNING:
                continue
            if self._allocate_running(req, 1, num_new, preempted, now):
                num_new[req.request_id] = 1
                budget -= 1
                decode_seqs += 1
                decode_context += req.num_computed_tokens + 1
        shape = StepShape(0, decode_seqs, decode_context, 0)
        # The step's time is budgeted only when prompts may be split (without chunking a
        # prompt is prefilled whole or not at all). While decodes wait on it, by the ITL
        # target, sized against the decodes just scheduled (shape holds only them yet);
        # without, by what a budget-sized chunk at a prompt's start takes (prefill_step_cap).
        if shape.decode_seqs:
            target = None if self._queue_overdue(now) else self.step_target(shape)
            if target is not None:
                self.itl_target_s = target
        else:
            target = self.prefill_step_cap()

        # Running partial prefills and waiting requests compete for the prefill budget (a
        # preemption above may have sent some back to the queue).
        if preempted:
            partials = [r for r in partials if r.status == RequestStatus.RUNNING]
        cands = [(self._prefill_key(r, i), r) for i, r in enumerate(partials)]
        base = len(cands)
        cands += [(self._prefill_key(r, base + i), r) for i, r in enumerate(self.waiting)]
        cands.sort(key=lambda c: c[0])
        # Requests left part-way through their prompt after this step (max_num_partial_prefills).
        partial_ids = {r.request_id for r in partials}
        blocked_by: str | None = None
        if preempted and len(self.waiting):
            blocked_by = "preemption"
        admitting = True
        for _, req in cands:
            if req.status == RequestStatus.RUNNING:
                if req.request_id in num_new or req not in self.running:
                    continue  # preempted (and re-queued) or already served this step
                start = req.num_computed_tokens
                n = self._num_new_tokens(req, budget)
                if target is not None:
                    n = self._time_limited(n, shape, start, not shape.prefill_tokens, target,
                                           completes=start + n >= req.num_tokens)
                if n <= 0:
                    blocked_by = blocked_by or ("token_budget" if budget <= 0 else "itl_target")
                    break
                if not self._allocate_running(req, n, num_new, preempted, now):
                    continue
                num_new[req.request_id] = n
                budget -= n
                shape = shape.plus_chunk(start, n)
                if start + n >= req.num_tokens:
                    partial_ids.discard(req.request_id)
                continue
            # A waiting (or preempted) request. Once one is held back, no later one is
            # admitted (strict order keeps the aging bound), but running partial prefills
            # further down still get their chunks: they hold blocks, and only progress
            # frees them.
            if not admitting:
                continue
            if preempted:
                blocked_by, admitting = blocked_by or "preemption", False
                continue
            if budget <= 0:
                blocked_by, admitting = "token_budget", False
                continue
            if len(self.running) >= cfg.max_num_seqs:
                blocked_by, admitting = "max_num_seqs", False
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit_tokens
            n = remaining
            if cfg.long_prefill_token_threshold is not None:
                n = min(n, cfg.long_prefill_token_threshold)
            if not cfg.enable_chunked_prefill and n > budget:
                blocked_by, admitting = "token_budget", False
                continue
            n = min(n, budget)
            if target is not None:
                n = self._time_limited(n, shape, num_hit_tokens, not shape.prefill_tokens,
                                       target, completes=n >= remaining)
                if n <= 0:
                    blocked_by, admitting = "itl_target", False
                    continue
            if n < remaining and self._partials_full(req, partial_ids):
                # It would be left part-way: others may still finish theirs in this step.
                blocked_by = blocked_by or "partial_prefills"
                continue
            reserve = None
            if cfg.admission_policy == "reserve":
                reserve = req.num_prompt_tokens + req.max_tokens
            if not self.kv.allocate_slots(
                req, n, hits, apply_watermark=True, reserve_up_to=reserve
            ):
                blocked_by, admitting = "kv_cache", False
                continue
            self.waiting.remove(req)
            self.kv.record_prefix_query(req.num_tokens, num_hit_tokens)
            if req.status == RequestStatus.PREEMPTED:
                req.timestamps.resumed.append(now)
            elif req.timestamps.first_scheduled is None:
                req.timestamps.first_scheduled = now
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            req.admit_seq = next(self._admit_counter)
            self.running.append(req)
            num_new[req.request_id] = n
            budget -= n
            shape = shape.plus_chunk(num_hit_tokens, n)
            if n < remaining:
                partial_ids.add(req.request_id)
        if blocked_by is None and len(self.waiting) and budget <= 0:
            blocked_by = "token_budget"

        scheduled = []
        num_prefill_tokens = 0
        num_decode_seqs = 0
        for req in self.running:
            n = num_new.get(req.request_id, 0)
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
                    block_ids=self.kv.block_ids(req.request_id),
                    sample=start + n == req.num_tokens,
                    is_prefill=is_prefill,
                    sampling_params=req.sampling_params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    eos_token_ids=req.eos_token_ids,
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_seqs=num_decode_seqs,
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            admission_blocked_by=blocked_by,
            num_decode_context_tokens=shape.decode_context_tokens,
            prefill_attention_pairs=shape.prefill_attention_pairs,
            predicted_s=self.step_model.predict(shape) if scheduled else None,
            kv_events=self.kv.take_events(),
        )

    def _allocate_running(self, req: Request, n: int, num_new: dict[str, int],
                          preempted: list[str], now: float) -> bool:
        """Blocks for ``n`` more tokens of a running request, preempting the newest admission
        not yet scheduled this step until they fit; False when ``req`` itself was the one."""
        while not self.kv.allocate_slots(req, n):
            candidates = [r for r in self.running if r.request_id not in num_new]
            victim = self._pick_victim(candidates)
            self._preempt(victim, now)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    # ---------------------------------------------------------------- update
    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def update_from_output(
        self, sched: SchedulerOutput, out: RunnerOutput, step_s: float
    ) -> list[EngineOutput]:
        now = self._clock()
        # The step-time model learns from every measured step (its prediction was made when
        # the step was built: sched.predicted_s).
        self.step_model.observe(self.shape_of(sched), step_s)
        has_prefill = sched.num_prefill_tokens > 0
        outputs = []
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished from outside while the step ran
            req.num_computed_tokens += len(s.token_ids)
            ts = req.timestamps
            ts.num_steps += 1
            if has_prefill:
                ts.num_steps_with_prefill += 1
                ts.time_in_steps_with_prefill += step_s
            if s.is_prefill and req.num_output_tokens == 0:
                ts.prefill_time += step_s
            if not s.sample:
                continue
            token = out.sampled_token_ids[s.request_id]
            req.append_output_token(token)
            new_logprobs = None
            if req.logprobs is not None and s.request_id in out.logprobs:
                new_logprobs = [out.logprobs[s.request_id]]
                req.logprobs.append(out.logprobs[s.request_id])
            if ts.first_token is None:
                ts.first_token = now
            status = self._check_stop(req, token)
            if status is None and s.request_id in out.grammar_stopped:
                status = RequestStatus.FINISHED_STOPPED
            eo = EngineOutput(
                s.request_id, [token], new_logprobs, num_cached_tokens=req.num_cached_tokens
            )
            if status is not None:
                self.running.remove(req)
                req.status = status
                self._free(req)
                eo.finish_reason = status.finish_reason
                eo.stop_reason = req.stop_reason
                eo.timestamps = ts
                eo.timing = req.timing()
            outputs.append(eo)
        return outputs

    @staticmethod
    def shape_of(sched: SchedulerOutput) -> StepShape:
        return StepShape(sched.num_prefill_tokens, sched.num_decode_seqs,
                         sched.num_decode_context_tokens, sched.prefill_attention_pairs)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        for req in self.running:
            if req.request_id not in self.kv.req_to_blocks:
                raise AssertionError(f"running request {req.request_id} holds no blocks")
            need = cdiv(req.num_computed_tokens, self.cache_config.block_size)
            if len(self.kv.req_to_blocks[req.request_id]) < need:
                raise AssertionError(f"{req.request_id}: fewer blocks than computed tokens")
        waiting_ids = {r.request_id for r in self.waiting}
        for rid in waiting_ids:
            if rid in self.kv.req_to_blocks:
                raise AssertionError(f"waiting request {rid} still holds blocks")
