"""Scheduler: continuous batching under a token budget and a step-time budget, chunked prefill
in SRPT order with aging, preemption.

The algorithm of one ``schedule()`` call, with ``budget = max_num_batched_tokens``:

1. **Running decodes first.** Every running request that needs exactly one token (a decode)
   gets it, in admission order, so a decode never waits behind anyone's prefill.
2. **Prefill by time.** Running partial prefills and waiting requests compete for what is
   left, in the waiting policy's ``prefill_key`` order (``engine/waiting_queue.py``): the
   earliest place ``arrival + remaining x aging`` (``srpt``: shortest remaining prefill
   first, and no request that arrives after a prompt's place ever passes it), or arrival
   order (``fcfs``); priority first under ``priority``.
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
from tailserve.data.step import EngineOutput, RunnerOutput, SchedulerOutput
from tailserve.engine.latency import (
    MIN_PREFILL_CHUNK,
    PREFILL_ALIGN,
    check_slo,
    decode_shape,
    is_decode,
    predict_ttft,
    step_target_s,
)
from tailserve.engine.step_budget import StepBudget
from tailserve.engine.step_phases import build_output, schedule_decodes, schedule_prefills
from tailserve.engine.waiting_queue import WaitingQueue, make_waiting_queue
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
        )
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = make_waiting_queue(
            config.scheduling_policy, config.prefill_scheduling, config.prefill_aging_s_per_token)
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
        of every request the budget serves before it (the policy's ``prefill_key`` order) plus
        its own."""
        now = self._clock()
        mine = self.waiting.prefill_key(req, len(self.running) + len(self.waiting), now)
        pending = [r for r in self.running if not is_decode(r)]
        pending += list(self.waiting)
        ahead = [r for i, r in enumerate(pending)
                 if self.waiting.prefill_key(r, i, now) <= mine]
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
        11 s; benchmarks/RESULTS.md). Preempted requests do not count: they were admitted
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

    def partials_full(self, req: Request, partial_ids: set[str]) -> bool:
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
    def schedule(self) -> SchedulerOutput:
        """One step: the phases of ``engine/step_phases.py`` over one ``StepBudget``."""
        b = StepBudget(tokens=self.config.max_num_batched_tokens, now=self._clock())
        partials = schedule_decodes(self, b)
        b.target_s = self._step_time_budget(b)
        schedule_prefills(self, b, partials)
        finished, self._finished_ids = self._finished_ids, []
        return build_output(self, b, finished)

    def _step_time_budget(self, b: StepBudget) -> float | None:
        """The time the step may take, given the decodes it carries (``b.shape`` holds only
        them yet). The step's time is budgeted only when prompts may be split (without
        chunking a prompt is prefilled whole or not at all). While decodes wait on it, by the
        ITL target; without, by what a budget-sized chunk at a prompt's start takes
        (``prefill_step_cap``)."""
        if b.shape.decode_seqs:
            target = None if self._queue_overdue(b.now) else self.step_target(b.shape)
            if target is not None:
                self.itl_target_s = target
            return target
        return self.prefill_step_cap()

    def next_admit_seq(self) -> int:
        return next(self._admit_counter)

    def preempt(self, req: Request, now: float) -> None:
        """Preemption by recompute: its blocks are freed, it keeps its output tokens and goes
        back to the front of the queue; its next prefill recomputes prompt + outputs, so its
        answer does not change."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.timestamps.preempted.append(now)
        self.num_preemptions_total += 1
        self.waiting.push(req, front=True)

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
