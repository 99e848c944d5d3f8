"""EngineCore: the engine's parts wired together, then steps. The loop reads in ten lines
(``step``); start-up is ``engine/build.py``'s."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from tailserve.config import EngineArgs, EngineConfig
from tailserve.data.records import SchedulerSnapshot
from tailserve.data.step import EngineOutput, RunnerOutput, SchedulerOutput, StepStats
from tailserve.engine.structured_output import StructuredOutputManager
from tailserve.errors import ConfigError, InvalidRequestError, QueueFullError
from tailserve.obs import profiling
from tailserve.obs.kv_events import ZmqKVEventPublisher
from tailserve.request import (
    Request,
    RequestStatus,
    check_prompt_token_ids,
    check_stop_token_ids,
)

if TYPE_CHECKING:
    from tailserve.engine.scheduler import Scheduler
    from tailserve.engine.tensor_parallel import TensorParallelWorkers
    from tailserve.model.loader import LoadedModel
    from tailserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

# An engine whose only requests wait for their grammar's matcher sleeps this long at most
# between checks, instead of spinning.
PENDING_WAIT_S = 0.005


class EngineCore:
    """An engine over a resolved ``EngineConfig``: the parts ``EngineBuilder``
    (``engine/build.py``) made, wired together; ``from_args`` builds one."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, runner: ModelRunner,
        scheduler: Scheduler, kv_events: ZmqKVEventPublisher | None = None,
        tp_workers: TensorParallelWorkers | None = None, startup_steps: Sequence[str] = (),
        grammar_tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.model_config = config.model
        self.loaded = loaded
        self.runner = runner  # its KV pool allocated
        self.scheduler = scheduler  # its step-time model calibrated
        self.kv_events = kv_events
        self.tp_workers = tp_workers  # ranks 1..T-1 (engine/tensor_parallel.py), closed here
        # What the Ready message reports, fixed once the weights are loaded (and transformed).
        self.model_source = loaded.source
        self.weight_bytes: dict[str, int] = dict(runner.weight_bytes)
        self.transforms: dict[str, dict[str, int]] = {
            name: dict(report.swapped) for name, report in runner.built.reports.items()}
        self.startup_steps = list(startup_steps)  # EngineBuilder.steps, in order
        # Structured output: matchers built off the loop; a constrained request waits in
        # _pending (outside the scheduler) until its matcher is there. ``grammar_tokenizer``:
        # llguidance's, built at start-up (the engine process); else built when first needed.
        self.structured = StructuredOutputManager(self._hf_tokenizer, config.model.vocab_size,
                                                  tokenizer=grammar_tokenizer)
        self._pending: list[Request] = []
        # Requests refused when they left _pending (the queue filled meanwhile, the grammar
        # failed to build): the loop answers each with a Rejected message.
        self.rejected: list[tuple[str, BaseException]] = []
        self._last_queries = 0
        self._last_hits = 0

    @classmethod
    def from_args(cls, args: EngineArgs, loaded: LoadedModel | None = None, *,
                  keep_checkpoint: bool = False, with_tokenizer: bool = True,
                  grammar_tokenizer: Future[Any] | None = None) -> EngineCore:
        """``EngineBuilder(args).build_engine(...)``: load (unless ``loaded`` is given),
        resolve ``args`` against the model, build (``engine/build.py``)."""
        from tailserve.engine.build import EngineBuilder

        return EngineBuilder(args).build_engine(loaded, keep_checkpoint=keep_checkpoint,
                                                with_tokenizer=with_tokenizer,
                                                grammar_tokenizer=grammar_tokenizer)

    def release_checkpoint(self) -> EngineCore:
        """Let the loaded checkpoint's tensors go once the runner holds its own (returns
        self). The runner keeps what it serves; the dict's other entries are copies: float
        values cast to the storage dtype, q/k/v and gate/up parts it concatenated, a rank's
        whole matrices it sliced (538 MB for the bundled model read as float32 and served as
        bfloat16). Config, tokenizer and source stay. Not for a ``LoadedModel`` handed in
        (``LLM.from_loaded``): its owner may build more engines from it."""
        self.loaded = dataclasses.replace(self.loaded, weights={})
        return self

    def add_request(self, req: Request) -> None:
        """Validate and queue; raises ``InvalidRequestError`` / ``QueueFullError``.

        The input processor ran these checks already; the engine runs them again because it
        stays the authority for whatever reaches it (the scheduler checks the lengths)."""
        check_prompt_token_ids(req.prompt_token_ids, self.model_config.vocab_size)
        check_stop_token_ids(req.sampling_params.stop_token_ids, self.model_config.vocab_size)
        if not req.eos_token_ids:
            req.eos_token_ids = self.model_config.eos_token_ids
        so = req.sampling_params.structured_outputs
        if so is None:
            self.scheduler.add_request(req)
            return
        self.scheduler.validate(req)  # what can never be served is refused now, not later
        if any(p.request_id == req.request_id for p in self._pending):
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use")
        self.structured.add(req.request_id, so)
        self._pending.append(req)

    def _hf_tokenizer(self) -> Any:
        """The model's tokenizer, for the grammar matchers (the worker thread calls this)."""
        if self.loaded.tokenizer is not None:
            return self.loaded.tokenizer
        from tailserve.model.loader import load_tokenizer

        return load_tokenizer(self.model_source)

    def _admit_ready(self) -> None:
        """Hand the scheduler each pending request whose matcher is built."""
        for req in [r for r in self._pending if self.structured.ready(r.request_id)]:
            self._pending.remove(req)
            exc = self.structured.take_error(req.request_id)
            if exc is None:
                try:
                    self.scheduler.add_request(req)
                except (ValueError, QueueFullError) as refused:  # as at the door
                    self.structured.free(req.request_id)
                    exc = refused
            if exc is not None:
                self.rejected.append((req.request_id, exc))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[EngineOutput]:
        """Finish requests from outside the step (client gone: ``FINISHED_ABORTED``; a stop
        string matched above the engine: ``FINISHED_STOPPED``) and free their blocks.

        Returns one final output per request that was still unfinished; ids already finished
        or unknown are skipped, so finishing twice is harmless.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        outputs = []
        for rid in request_ids:
            self.structured.free(rid)
        pending = [r for r in self._pending if r.request_id in set(request_ids)]
        for req in pending:  # not in the scheduler yet: nothing of it was computed
            self._pending.remove(req)
            req.status = status
            req.timestamps.finished = time.monotonic()
        for req in [*self.scheduler.finish_requests(request_ids, status), *pending]:
            outputs.append(
                EngineOutput(
                    req.request_id, [], finish_reason=status.finish_reason,
                    stop_reason=req.stop_reason, num_cached_tokens=req.num_cached_tokens,
                    timestamps=req.timestamps, timing=req.timing(),
                )
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def unfinished_request_ids(self) -> list[str]:
        return [*self.scheduler.requests, *(r.request_id for r in self._pending)]

    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler's and block manager's counters now (gauges, heartbeats)."""
        return self.scheduler.snapshot()

    def step(self) -> tuple[list[EngineOutput], StepStats | None]:
        t0 = time.perf_counter()
        if self._pending:
            self._admit_ready()
        with profiling.span("schedule"):
            sched = self.scheduler.schedule()
        if self.kv_events is not None:
            # Before the forward: a router may route the next request here while it runs.
            self.kv_events.publish(sched.kv_events)
        if not sched.scheduled:
            if self._pending:  # only grammars building: wait for one, do not spin
                self.structured.wait_any(PENDING_WAIT_S)
            return [], None
        constrained = len(self.structured) > 0  # an unconstrained engine pays nothing below
        if constrained:
            with profiling.span("grammar_masks"):
                sched.token_bitmasks = self.structured.bitmasks(
                    [s.request_id for s in sched.scheduled if s.sample])
        runner_out = self.runner.execute(sched)
        if constrained:
            self._advance_matchers(runner_out)
        step_s = time.perf_counter() - t0
        with profiling.span("update"):
            outputs = self.scheduler.update_from_output(sched, runner_out, step_s)
        if constrained:
            for out in outputs:
                if out.finished:
                    self.structured.free(out.request_id)
        return outputs, self._stats(sched, step_s, outputs)

    def _advance_matchers(self, runner_out: RunnerOutput) -> None:
        """Each sampled token advances its request's matcher; a complete grammar ends the
        request (the scheduler's update reads ``grammar_stopped``)."""
        structured = self.structured
        for rid, token in runner_out.sampled_token_ids.items():
            if rid not in structured:
                continue
            if structured.accept(rid, token):
                runner_out.grammar_stopped.add(rid)
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.timestamps.grammar_s = structured.grammar_s.get(rid, 0.0)

    def close(self) -> None:
        """Release what outlives a step (the KV-events sockets); the engine is done."""
        self.structured.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    def _stats(
        self, sched: SchedulerOutput, step_s: float, outputs: list[EngineOutput]
    ) -> StepStats:
        snap = self.scheduler.snapshot()
        kv = snap.kv
        stats = StepStats(
            t=time.time(),
            step_s=step_s,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_seqs=sched.num_decode_seqs,
            num_scheduled_seqs=len(sched.scheduled),
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            free_blocks=kv.num_free_blocks,
            total_blocks=kv.num_blocks,
            num_preemptions=len(sched.preempted_request_ids),
            prefix_cache_queries=kv.prefix_cache_queries - self._last_queries,
            prefix_cache_hits=kv.prefix_cache_hits - self._last_hits,
            num_finished=sum(1 for o in outputs if o.finished),
            admission_blocked_by=sched.admission_blocked_by,
            predicted_s=sched.predicted_s,
            num_decode_context_tokens=sched.num_decode_context_tokens,
            prefill_attention_pairs=sched.prefill_attention_pairs,
            itl_target_s=snap.itl_target_s,
            min_decode_slack_s=snap.min_decode_slack_s,
            step_model=snap.step_model,
            prefill_step_cap_s=snap.prefill_step_cap_s,
            prefill_step_cap_by=snap.prefill_step_cap_by,
            busy_arrival_rate=snap.busy_arrival_rate,
        )
        self._last_queries, self._last_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        return stats


def open_kv_events(config: EngineConfig) -> ZmqKVEventPublisher | None:
    cfg = config.kv_events
    if cfg is None or not cfg.enabled:
        return None
    try:
        publisher = ZmqKVEventPublisher(
            cfg.endpoint, topic=cfg.topic, replay_endpoint=cfg.replay_endpoint,
            buffer_steps=cfg.buffer_steps, hwm=cfg.hwm,
        )
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"kv_events_config: cannot open {cfg.endpoint!r} / {cfg.replay_endpoint!r}: {exc}"
        ) from None
    logger.info("KV cache events on %s (topic %r, replay %s)", cfg.endpoint, cfg.topic,
                cfg.replay_endpoint or "off")
    return publisher
