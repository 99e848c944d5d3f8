"""ServerContext: what every route shares — the engine client, the tokenizer and the input
processor, admission and drain state, and the sinks a finished request is written to
(metrics, timeline, traces)."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request

from tailserve.config import EngineConfig
from tailserve.data.records import RequestRecord
from tailserve.engine.client import EngineClient
from tailserve.engine.input_processor import InputProcessor
from tailserve.obs.metrics import ServerMetrics
from tailserve.obs.timeline import Timeline
from tailserve.request import RequestStatus
from tailserve.sampling_params import SamplingParams
from tailserve.server.dashboard.feed import DashboardFeed
from tailserve.server.errors import APIError, bad_request, unavailable
from tailserve.server.heap import HeapTrimmer
from tailserve.server.settings import ServerSettings
from tailserve.server.structured import GrammarChecker
from tailserve.server.tenants import Tenant, TenantLimits

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_TICKET = "tailserve.admission_ticket"
# A body this large is a prompt worth trimming the heap after (a 64 kB prompt tokenizes into
# ~16k ids); glibc's malloc arenas capped at two (the event loop's and the workers' share).
LARGE_REQUEST_BYTES = 64 << 10
MALLOC_ARENA_MAX = 2


def served_names(model: str | None, source: str, override: str | None) -> list[str]:
    """The names a request's ``model`` may use; the first is the one responses carry."""
    if override:
        names = [override]
    elif model is None:
        names = [DEFAULT_MODEL_NAME]
    else:
        base = os.path.basename(os.path.normpath(source))
        names = [base.removesuffix(".gguf")]
    for extra in (model, source):
        if extra and extra not in names:
            names.append(extra)
    return names


def tokenize_pool(workers: int, nice: int) -> ThreadPoolExecutor:
    """The threads that tokenize and template prompts, each ``nice`` below its process.

    Which work gets the cores when all of it is busy, made explicit: the engine process
    (steps every admitted request waits on) and the event loop (/health, refusals, every
    stream's tokens) run at the process's priority; a worker's bulk tokenizing of a huge
    prompt, done for one request, yields to both. Linux gives each thread its own niceness;
    raising it needs no privilege.
    """

    def lower_priority() -> None:
        if nice and hasattr(os, "setpriority"):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)

    return ThreadPoolExecutor(workers, thread_name_prefix="tailserve-tokenize",
                              initializer=lower_priority)


class ServerContext:
    def __init__(
        self,
        settings: ServerSettings,
        client: EngineClient,
        tokenizer: Any,
        model_names: list[str],
        metrics: ServerMetrics,
        timeline: Timeline,
        tracer: Any = None,
        tenant_keys: dict[bytes, Tenant] | None = None,
        lltokenizer: Any = None,
    ) -> None:
        assert client.info is not None, "start the engine client first"
        self.settings = settings
        self.client = client
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.metrics = metrics
        self.timeline = timeline
        self.tracer = tracer
        # --api-keys: {SHA-256 of a key: its tenant}; None when the file is not used.
        self.tenant_keys = tenant_keys
        self.tenant_limits = TenantLimits(client.is_inflight)
        # What the engine resolved, read here once: admission, /v1/models and the input
        # processor (which shapes and validates every prompt) take their limits from it.
        self.config: EngineConfig = client.info.config
        self.input_processor = InputProcessor(tokenizer, self.config.request_limits)
        # Tokenizing a long prompt takes the caller's thread for up to seconds; on the event
        # loop that would stall /health and every running stream's tokens. The fast
        # tokenizer's Rust encode releases the GIL, so a few threads keep the loop free; a
        # bounded pool so a burst of huge prompts queues here instead of taking every core.
        self.tokenize_pool = tokenize_pool(settings.tokenizer_workers, settings.tokenizer_nice)
        # Structured output's grammars: compiled and timed off the event loop, cached; each
        # compile's time goes to /metrics.
        self.grammar = GrammarChecker(tokenizer, settings.grammar_timeout_ms / 1e3,
                                      on_compiled=metrics.on_grammar_compiled,
                                      lltokenizer=lltokenizer)
        # What a huge prompt's tokenizing took goes back to the OS once it is done (heap.py);
        # the arena cap is set here, before the first tokenize thread starts.
        self.heap = HeapTrimmer(LARGE_REQUEST_BYTES, MALLOC_ARENA_MAX, self.tokenize_pool.submit)
        # Generation requests past the early gate (middleware.py) and not yet admitted: each
        # holds one sequence's place while its body is parsed and its prompt tokenized.
        self.num_pending = 0
        self.draining = False
        self.exit_code = 0
        self.started = time.time()
        # Set by the runner: asks the HTTP server to stop (after a drain or an engine death).
        self.request_exit: Callable[[], None] = lambda: None
        # The step's stats go from the client straight to each sink (no hop through here).
        self.dashboard = DashboardFeed(metrics, lambda: client.state)
        client.step_listeners += [metrics.on_step, timeline.add_step, self.dashboard.on_step]
        client.state_listeners.append(metrics.on_engine_state)
        cache = self.config.cache
        metrics.on_cache_config(
            block_size=cache.block_size, num_kv_blocks=cache.num_kv_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            cache_dtype=self.config.runner.kv_cache_dtype,
        )
        run = self.config.runner
        metrics.on_dtypes(weight_dtype=run.dtype, compute_dtype=run.compute_dtype,
                          cache_dtype=run.kv_cache_dtype)
        metrics.on_weights(client.info.weight_bytes)
        metrics.on_transforms(client.info.transforms)
        metrics.on_slo_config(ttft_s=self.config.scheduler.slo_ttft_s,
                              itl_s=self.config.scheduler.slo_itl_s)
        if client.state is None:
            metrics.on_ready(cache.num_kv_blocks)
        else:
            metrics.on_engine_state(client.state)
        client.death_listeners.append(self._on_engine_death)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenize pool: input shaping (tokenize, template, checks)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenize_pool, functools.partial(fn, *args)
        )

    # ---------------------------------------------------------------- checks
    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves "
                f"{self.model_names[0]!r}", "invalid_request_error", "model", "model_not_found",
            )

    def model_name(self) -> str:
        """The name responses carry: the first served name, whichever alias was asked for."""
        return self.model_names[0]

    # ---------------------------------------------------------------- admission
    def early_refusal(self, tenant: Tenant | None = None) -> APIError | None:
        """The answer for a generation request before its body is read, if it can only be a
        refusal: 503 while the engine is gone or the server drains, 429 when the requests in
        flight and those already past this gate fill the capacity (every request is at least
        one sequence) -- unless other tenants are in flight and ``tenant`` is within its
        share of it (``admit``). ``None``: let it in; it takes a ticket (``take_ticket``)."""
        if self.client.gone_reason is not None:
            return self.dead_error()
        if self.draining:
            return unavailable("the server is shutting down", "draining")
        cfg = self.config.scheduler
        if cfg.max_queue_len is None:
            return None
        capacity = cfg.max_num_seqs + cfg.max_queue_len
        inflight = self.client.num_inflight
        if inflight + self.num_pending + 1 > capacity:
            share = (None if tenant is None
                     else self.tenant_limits.capacity_share(tenant, 1, capacity))
            if share is not None:
                within, why = share
                return None if within else self.queue_full_error(why)
            arriving = f" and {self.num_pending} arriving" if self.num_pending else ""
            return self.queue_full_error(
                f"the server is at capacity ({inflight} requests in flight{arriving}; "
                f"max_num_seqs {cfg.max_num_seqs} + max_queue_len {cfg.max_queue_len})"
            )
        return None

    def take_ticket(self, state: dict[str, Any]) -> None:
        self.num_pending += 1
        state[_TICKET] = True

    def return_ticket(self, state: dict[str, Any] | None) -> None:
        """Give back the request's place at the gate, once: at admission or when it ends."""
        if state is not None and state.pop(_TICKET, False):
            self.num_pending -= 1

    def admit(self, num_prompts: int, n: int, state: dict[str, Any] | None = None) -> None:
        """Shed load before any work is done, for a request of ``num_prompts`` x ``n`` engine
        requests: 400 when no amount of waiting could admit it, 503 while dead or draining,
        429 when full. ``state``: the request's ASGI state, whose gate ticket is given back
        first (from here the request is counted in flight or refused).

        Admission counts the client's in-flight requests, which ``EngineClient.add_request``
        and ``finish`` keep exact on every path: nothing is reserved here that a failed
        hand-off would have to give back (the gate's ticket is returned in the same
        synchronous stretch that registers the request, and by the gate itself on any other
        way out).
        """
        self.return_ticket(state)
        cfg = self.config.scheduler
        capacity = None
        if cfg.max_queue_len is not None:
            capacity = cfg.max_num_seqs + cfg.max_queue_len
            self._check_admissible(num_prompts, n, capacity)
        if self.client.gone_reason is not None:
            raise self.dead_error()
        if self.draining:
            raise unavailable("the server is shutting down", "draining")
        if capacity is None:
            return
        inflight = self.client.num_inflight
        if inflight + num_prompts * n > capacity:
            tenant: Tenant | None = (state or {}).get("tenant")
            share = (None if tenant is None else
                     self.tenant_limits.capacity_share(tenant, num_prompts * n, capacity))
            if share is not None:
                within, why = share
                if within:
                    return  # the tenants over their share are the ones refused
                raise self.queue_full_error(why)
            raise self.queue_full_error(
                f"the server is at capacity ({inflight} requests in flight; "
                f"max_num_seqs {cfg.max_num_seqs} + max_queue_len {cfg.max_queue_len})"
            )

    def _check_admissible(self, num_prompts: int, n: int, capacity: int) -> None:
        """A request larger than the whole capacity is a 400: a 429 would have clients (the
        openai SDK among them) retry it forever."""
        total = num_prompts * n
        if total <= capacity:
            return
        cfg = self.config.scheduler
        limit = (f"this server holds at most {capacity} sequences at once (max_num_seqs "
                 f"{cfg.max_num_seqs} + max_queue_len {cfg.max_queue_len}), so the request "
                 "can never be admitted")
        if num_prompts == 1:
            raise bad_request(f"n is {n} but {limit}", param="n")
        raise bad_request(
            f"{num_prompts} prompts with n {n} make {total} sequences but {limit}",
            param="n" if n > capacity else "prompt",
        )

    def queue_full_error(self, message: str, retry_after_s: float | None = None,
                         code: str = "queue_full") -> APIError:
        retry = self.settings.retry_after_s if retry_after_s is None else retry_after_s
        return APIError(
            429, message, "rate_limit_error", None, code,
            headers={"Retry-After": str(max(1, math.ceil(retry)))},
        )

    def dead_error(self, reason: str | None = None) -> APIError:
        """503 engine_dead; ``reason`` defaults to why the client says the engine is gone."""
        why = reason or self.client.gone_reason or "the engine has stopped"
        return unavailable(f"the engine is not running: {why}", "engine_dead")

    # ---------------------------------------------------------------- sinks
    def on_choice_finished(
        self, http: Request, params: SamplingParams
    ) -> Callable[[RequestRecord], None]:
        traceparent = http.headers.get("traceparent")
        path = http.url.path

        def record(rec: RequestRecord) -> None:
            rec.model = self.model_names[0]
            if rec.finish_reason == "error":
                rec.error_type = "engine_error"
            self.metrics.on_request_finished(rec)
            self.timeline.add_request(rec)
            self.dashboard.on_request(rec)
            if self.tracer is not None:
                self._trace(rec, traceparent, path, params)

        return record

    def _trace(
        self, rec: RequestRecord, traceparent: str | None, path: str, params: SamplingParams
    ) -> None:
        op = "chat" if path.endswith("/chat/completions") else "text_completion"
        attributes = {
            "gen_ai.operation.name": op,
            "gen_ai.system": "tailserve",
            "gen_ai.request.model": rec.model,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.response.id": rec.request_id,
            "gen_ai.response.finish_reasons": [rec.finish_reason or ""],
            "gen_ai.usage.input_tokens": rec.prompt_tokens,
            "gen_ai.usage.output_tokens": rec.output_tokens,
        }
        try:
            self.tracer.record(
                rec, traceparent=traceparent, attributes=attributes,
                start_wall=rec.arrival_time or rec.t, end_wall=rec.finished_time or rec.t,
            )
        except Exception:  # tracing must never fail a request
            logger.exception("could not record a trace span")

    # ---------------------------------------------------------------- lifecycle
    def _on_engine_death(self, reason: str) -> None:
        self.metrics.on_rejected("engine_dead")
        self.exit_code = 1
        # Give the failed requests a moment to receive their 500s, then stop so a supervisor
        # restarts the server.
        asyncio.get_running_loop().call_later(1.0, self.request_exit)

    async def drain(self) -> None:
        """SIGTERM: stop admitting, let in-flight requests finish up to shutdown_timeout, then
        abort the rest (they end with finish_reason "abort"), then stop the server."""
        if self.draining:
            return
        self.draining = True
        timeout = self.settings.shutdown_timeout
        logger.info(
            "draining: %d requests in flight, up to %.0f s", self.client.num_inflight, timeout
        )
        deadline = time.monotonic() + timeout
        while self.client.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.client.num_inflight:
            logger.warning("aborting %d requests still in flight", self.client.num_inflight)
            # Their "abort" outputs still come, so each stream ends with a finish_reason.
            self.client.finish(
                self.client.inflight_request_ids, RequestStatus.FINISHED_ABORTED,
                deliver_final=True,
            )
            end = time.monotonic() + 5.0
            while self.client.num_inflight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.request_exit()
