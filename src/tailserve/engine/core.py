"""EngineCore: load, size the KV pool, then step. The loop reads in ten lines (``step``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tailserve.config import EngineArgs, SchedulerConfig
from tailserve.data.engine_output import EngineOutput
from tailserve.data.scheduler_output import SchedulerOutput
from tailserve.data.snapshot import SchedulerSnapshot
from tailserve.data.step_stats import StepStats
from tailserve.engine.scheduler import Scheduler
from tailserve.errors import ConfigError
from tailserve.model.runner import ModelRunner, resolve_device
from tailserve.obs.profiling import span
from tailserve.request import Request, RequestStatus
from tailserve.request_limits import check_prompt_token_ids

if TYPE_CHECKING:
    from tailserve.model.loader import LoadedModel

logger = logging.getLogger(__name__)

DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 4096}


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        if loaded is None:
            from tailserve.model.loader import load_model

            loaded = load_model(args.model)
        self.loaded = loaded
        cfg = self.loaded.config
        self.model_config = cfg
        max_model_len = args.max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({max_model_len}) exceeds the model's context length "
                f"({cfg.max_position_embeddings})"
            )
        self.max_model_len = max_model_len
        t0 = time.perf_counter()
        device_type = resolve_device(args.device).type
        budget = args.max_num_batched_tokens
        if budget is None:
            # The default must hold every running decode, and whole prompts when not chunking.
            budget = max(DEFAULT_BATCHED_TOKENS.get(device_type, 512), args.max_num_seqs)
            if not args.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        self.runner = ModelRunner(cfg, self.loaded.weights, args, max_model_len, budget)
        # Validates that one max_model_len sequence fits before a byte of KV is allocated.
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            block_size=args.block_size,
            num_kv_blocks=self.runner.num_kv_blocks,
            watermark=args.watermark,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            admission_policy=args.admission_policy,
            scheduling_policy=args.scheduling_policy,
            max_queue_len=args.max_queue_len,
        )
        self.runner.allocate_kv_cache()
        self.scheduler = Scheduler(self.scheduler_config)
        self._last_queries = 0
        self._last_hits = 0
        logger.info(
            "engine ready in %.1fs: %s %s on %s, %d KV blocks x %d tokens (%.2f GiB), budget %d",
            time.perf_counter() - t0, cfg.architecture, self.runner.dtype, self.runner.device,
            self.runner.num_kv_blocks, args.block_size, self.runner.kv_cache_bytes / (1 << 30),
            budget,
        )

    def add_request(self, req: Request) -> None:
        """Validate and queue; raises ``InvalidRequestError`` / ``QueueFullError``.

        The input processor ran these checks already; the engine runs them again because it
        stays the authority for whatever reaches it (the scheduler checks the lengths)."""
        check_prompt_token_ids(req.prompt_token_ids, self.model_config.vocab_size)
        if not req.eos_token_ids:
            req.eos_token_ids = self.model_config.eos_token_ids
        self.scheduler.add_request(req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[EngineOutput]:
        """Finish requests from outside the step (client gone: ``FINISHED_ABORTED``; a stop
        string matched above the engine: ``FINISHED_STOPPED``) and free their blocks.

        Returns one final output per request that was still unfinished; ids already finished
        or unknown are skipped, so finishing twice is harmless.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        outputs = []
        for req in self.scheduler.finish_requests(request_ids, status):
            outputs.append(
                EngineOutput(
                    req.request_id, [], finish_reason=status.finish_reason,
                    stop_reason=req.stop_reason, num_cached_tokens=req.num_cached_tokens,
                    timestamps=req.timestamps, timing=req.timing(),
                )
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def snapshot(self) -> SchedulerSnapshot:
        """The scheduler's and block manager's counters now (gauges, heartbeats)."""
        return self.scheduler.snapshot()

    def step(self) -> tuple[list[EngineOutput], StepStats | None]:
        t0 = time.perf_counter()
        with span("schedule"):
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            return [], None
        runner_out = self.runner.execute(sched)
        step_s = time.perf_counter() - t0
        with span("update"):
            outputs = self.scheduler.update_from_output(sched, runner_out, step_s)
        return outputs, self._stats(sched, step_s, outputs)

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
        )
        self._last_queries, self._last_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        return stats
