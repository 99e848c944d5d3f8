"""Scheduler: continuous batching under a token budget and the requests' SLOs, chunked
prefill in the waiting policy's order, preemption.

One ``schedule()`` call runs the phases of ``engine/step_phases.py`` over one ``StepBudget``
(``max_num_batched_tokens`` tokens):

1. **Running decodes first**, in admission order, so a decode never waits behind anyone's
   prefill. Each decode's next token is due at its last token + its ITL SLO.
2. **The step's time budget** (``engine/step_time.py``): the smallest slack among those
   decodes less a margin from the step-time model's error (``latency.step_time_budget``);
   prefill takes all of it. With no decode, the tightest ITL SLO caps the step
   (``prefill_step_cap``) and prefill takes the whole token budget within it (a short
   prompt that completes may take it to twice the cap; a long prompt's chunk rides behind
   another prompt's first token in at most as much time again: ``step_phases``'s
   ``_time_limited``). Neither binds while the queue is overdue
   (``queue_overdue``): prefill then takes the whole token budget. While more than one
   tenant is present, the shared cap (``shared_step_cap``) binds too.
3. **Partial prefills and admissions** in the waiting policy's ``prefill_key`` order
   (``engine/waiting_queue.py``: earliest deadline first under ``deadline``, the default;
   SRPT with aging or arrival order under ``fcfs``; priority first under ``priority``), each
   chunk the largest multiple of ``PREFILL_ALIGN`` (else 16 or 8 tokens) within the budget
   (``latency.time_limited_chunk``). At most ``max_num_partial_prefills`` requests are left
   part-way through their prompt, and of those at most ``max_long_partial_prefills`` longer
   than the token budget. Admission needs ``max_num_seqs``, the KV pool and the watermark;
   ``reserve`` allocates prompt + max_tokens up front and never preempts.
4. When a running request cannot get a block, the policy's victim (the most slack under
   ``deadline``, else the newest admission, lowest priority first under ``priority``) is
   **preempted by recompute**; no admission follows in that step.

``add_request`` holds a request to its SLO (its own over the server's), bounds the queue by
what can actually start (``_check_queue_bound``) and, with ``enable_slo_admission``, refuses
a request predicted to miss its TTFT SLO (``engine/latency.py``). ``update_from_output``
applies the sampled tokens, stamps timestamps, decides who stops and feeds the measured step
time to the step-time model. Torch-free: tests drive it with a fake runner and a fake clock
and assert exact block ids and chunk sizes.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable

from tailserve.config import (
    CacheConfig,
    SchedulerConfig,
    check_pool_fits,
    max_request_tokens,
)
from tailserve.data.records import SchedulerSnapshot
from tailserve.data.step import EngineOutput, RunnerOutput, SchedulerOutput
from tailserve.engine.admission import check_admissible, check_queue_bound
from tailserve.engine.arrival_watch import ArrivalWatch
from tailserve.engine.latency import (
    MIN_PREFILL_CHUNK,
    PREFILL_ALIGN,
    check_slo,
    is_decode,
    predict_ttft,
    step_time_budget,
)
from tailserve.engine.step_budget import StepBudget
from tailserve.engine.step_phases import build_output, schedule_decodes, schedule_prefills
from tailserve.engine.step_time import (
    prefill_step_cap,
    prefill_step_cap_by,
    present_tenants,
    step_time_target,
)
from tailserve.engine.tenant_share import TenantShares
from tailserve.engine.waiting_queue import WaitingQueue, make_waiting_queue
from tailserve.errors import InvalidRequestError
from tailserve.kv.manager import KVCacheManager, cdiv
from tailserve.request import (
    SLO,
    Request,
    RequestStatus,
    SequenceLimits,
    check_request_lengths,
)
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
        # The time budget of the last step that carried decodes (their smallest slack less
        # the margin: latency.step_time_budget) and that slack; None while none was sized.
        self.itl_target_s: float | None = None
        self.min_decode_slack_s: float | None = None
        # The SLO of a request that brings none (per part).
        self.default_slo = SLO(config.slo_ttft_s, config.slo_itl_s, config.slo_tpot_s)
        self.cache_config = cache
        self._lengths = SequenceLimits(
            config.max_model_len, cache.block_size, cache.num_usable_blocks,
            max_request_tokens(config, cache), cache.group_windows,
        )
        self.kv = KVCacheManager(
            cache.num_kv_blocks,
            cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            watermark=cache.watermark,
            enable_kv_cache_events=cache.enable_kv_cache_events,
            hash_algo=cache.prefix_caching_hash_algo,
            group_windows=cache.group_windows,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = make_waiting_queue(
            config.scheduling_policy, config.prefill_scheduling, config.prefill_aging_s_per_token,
            self.own_prefill_s, self.idle_prefill_s)
        self.running: list[Request] = []
        # Fair share across tenants (engine/tenant_share.py); idle with one tenant.
        self.tenants = TenantShares()
        # Arrivals that found the engine busy, per second of work: how long a step without
        # decodes may take (step_time.prefill_step_cap).
        self.arrivals = ArrivalWatch(clock())
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
        if not (math.isfinite(req.tenant_weight) and 0 < req.tenant_weight <= 1000):
            raise InvalidRequestError(
                f"tenant_weight must be in (0, 1000], got {req.tenant_weight}")
        check_admissible(self, req)

    def add_request(self, req: Request) -> None:
        self.validate(req)
        req.slo_given_ttft = req.slo.ttft_s is not None
        req.slo = req.slo.over(self.default_slo)
        check_queue_bound(self, req)
        slo_s = req.slo.ttft_s
        if slo_s is not None and (self.config.enable_slo_admission or req.slo_given_ttft):
            predicted, idle = self.predict_ttft(req)
            check_slo(req, slo_s, predicted, idle, len(self.waiting), len(self.running),
                      refuse=self.config.enable_slo_admission)
        req.status = RequestStatus.WAITING
        now = self._clock()
        self.arrivals.arrived(req.arrival_time, now, engine_busy=bool(self.requests))
        self.tenants.arrived(req.tenant, now)
        self.requests[req.request_id] = req
        self.waiting.push(req)

    # ---------------------------------------------------------------- predicted latency
    def idle_prefill_s(self, req: Request) -> float:
        """A request's whole prompt prefilled alone, predicted as one step."""
        return self.step_model.predict(StepShape().plus_chunk(0, req.num_tokens))

    def own_prefill_s(self, req: Request) -> float:
        """A request's remaining prefill alone, predicted as one step (a lower bound)."""
        return self.step_model.predict(StepShape().plus_chunk(
            req.num_computed_tokens, req.num_tokens - req.num_computed_tokens))

    def predict_ttft(self, req: Request) -> tuple[float, float]:
        """(predicted TTFT now, on an idle engine) of a request not yet queued: the prefill
        of every request the budget serves before it (the policy's ``prefill_key`` order) plus
        its own."""
        now = self._clock()
        mine = self.waiting.prefill_key(req, len(self.running) + len(self.waiting), now)
        pending = [r for r in self.running if not is_decode(r)]
        pending += list(self.waiting)
        keyed = [(self.waiting.prefill_key(r, i, now), r) for i, r in enumerate(pending)]
        if any(r.tenant != req.tenant for _, r in keyed):
            # Across tenants the budget goes by fair share: a flood from another tenant is
            # not all ahead of this one.
            keyed.append((mine, req))
            keyed.sort(key=lambda c: c[0])
            fair = self.tenants.order(keyed)
            ahead = fair[:next(i for i, r in enumerate(fair) if r is req)]
        else:
            ahead = [r for k, r in keyed if k <= mine]
        itl = [r.slo.itl_s for r in self.running if is_decode(r) and r.slo.itl_s is not None]
        budget = (step_time_budget(self.step_model, min(itl))
                  if itl and self.config.enable_chunked_prefill else None)
        return predict_ttft(self.step_model, self.config.max_num_batched_tokens, budget,
                            self.running, ahead, req, prefill_step_cap(self))

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

    def now(self) -> float:
        return self._clock()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def snapshot(self) -> SchedulerSnapshot:
        """Queue lengths, preemptions, the block manager's counters, the step-time model (its
        ``describe``: well under a microsecond) and the cap on a step without decodes with the
        arrival rate behind it (two predictions: a few microseconds), as a frozen value."""
        cap_s, cap_by = prefill_step_cap_by(self)
        return SchedulerSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions_total=self.num_preemptions_total,
            kv=self.kv.snapshot(),
            itl_target_s=self.itl_target_s,
            min_decode_slack_s=self.min_decode_slack_s,
            step_model=self.step_model.describe(),
            prefill_step_cap_s=cap_s,
            prefill_step_cap_by=cap_by,
            busy_arrival_rate=self.arrivals.rate(self._clock()),
        )

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """One step: the phases of ``engine/step_phases.py`` over one ``StepBudget``."""
        b = StepBudget(tokens=self.config.max_num_batched_tokens, now=self._clock())
        b.present = present_tenants(self, b.now)
        partials = schedule_decodes(self, b)
        b.target_s = step_time_target(self, b)
        schedule_prefills(self, b, partials)
        finished, self._finished_ids = self._finished_ids, []
        return build_output(self, b, finished)

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
        self.arrivals.stepped(now, step_s)
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
            if ts.last_token is not None:
                ts.max_itl = max(ts.max_itl, now - ts.last_token)
            ts.last_token = now
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
