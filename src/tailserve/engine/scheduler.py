"""Scheduler: continuous batching under a token budget, chunked prefill, preemption.

The algorithm of one ``schedule()`` call, with ``budget = max_num_batched_tokens``:

1. **Running decodes first.** Every running request that needs exactly one token (a decode)
   gets it, in admission order, so a decode never waits behind anyone's prefill.
2. **Running prefills next.** Requests part-way through their prompt get the next chunk:
   ``min(remaining, long_prefill_token_threshold, budget left)``.
3. When a running request cannot get a block, the newest admission not yet scheduled this
   step (by priority first under ``priority``) is **preempted by recompute**: its blocks are
   freed, it keeps its output tokens and goes back to the front of the queue, and its next
   prefill recomputes prompt + outputs, so its answer does not change.
4. **Admission.** If nothing was preempted, waiting requests are admitted in queue order
   while the budget, ``max_num_seqs`` and the KV pool allow. ``optimistic`` admits on the
   first chunk's blocks and must leave the watermark free; ``reserve`` allocates blocks for
   prompt + max_tokens up front and therefore never preempts.

``update_from_output`` applies the sampled tokens, stamps timestamps and decides who stops.
Torch-free: tests drive it with a fake runner and assert exact block ids.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator

from tailserve.config import CacheConfig, SchedulerConfig, check_pool_fits, max_request_tokens
from tailserve.data.records import SchedulerSnapshot
from tailserve.data.step import EngineOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.kv.manager import KVCacheManager, cdiv
from tailserve.request import Request, RequestStatus, SequenceLimits, check_request_lengths


class WaitingQueue:
    """FCFS (a deque; preempted requests return to the front) or priority (a heap on
    ``(priority, arrival_time)``: lower value first, as vLLM orders it)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def push(self, req: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            if front:
                self._deque.appendleft(req)
            else:
                self._deque.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._deque.remove(req)
        else:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "fcfs":
            return iter(list(self._deque))
        return iter([e[3] for e in sorted(self._heap)])


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig) -> None:
        check_pool_fits(config, cache)
        self.config = config
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
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)

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
        req.timestamps.finished = time.monotonic()
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def snapshot(self) -> SchedulerSnapshot:
        """Queue lengths, preemptions and the block manager's counters, as a frozen value."""
        return SchedulerSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions_total=self.num_preemptions_total,
            kv=self.kv.snapshot(),
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

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = time.monotonic()
        budget = cfg.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted: list[str] = []

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0 or req.status != RequestStatus.RUNNING:
                continue
            n = self._num_new_tokens(req, budget)
            while not self.kv.allocate_slots(req, n):
                candidates = [r for r in self.running if r.request_id not in num_new]
                victim = self._pick_victim(candidates)
                self._preempt(victim, now)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                num_new[req.request_id] = n
                budget -= n

        blocked_by: str | None = None
        if preempted and len(self.waiting):
            blocked_by = "preemption"
        while not preempted and len(self.waiting):
            if budget <= 0:
                blocked_by = "token_budget"
                break
            if len(self.running) >= cfg.max_num_seqs:
                blocked_by = "max_num_seqs"
                break
            req = self.waiting.peek()
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit_tokens
            if cfg.long_prefill_token_threshold is not None:
                n = min(n, cfg.long_prefill_token_threshold)
            if not cfg.enable_chunked_prefill and n > budget:
                blocked_by = "token_budget"
                break
            n = min(n, budget)
            reserve = None
            if cfg.admission_policy == "reserve":
                reserve = req.num_prompt_tokens + req.max_tokens
            if not self.kv.allocate_slots(
                req, n, hits, apply_watermark=True, reserve_up_to=reserve
            ):
                blocked_by = "kv_cache"
                break
            self.waiting.pop()
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
        )

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
        now = time.monotonic()
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
