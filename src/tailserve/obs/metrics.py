"""Prometheus rendering of the engine's plain stats (``/metrics``).

Names mirror vLLM's with the ``tailserve:`` prefix so Grafana dashboards port by a rename.
Quirks of prometheus_client that shape the code below:

- A Counter's ``_total`` suffix is added by the library: ``Counter("tailserve:prompt_tokens")``
  renders ``tailserve:prompt_tokens_total`` (plus a ``_created`` timestamp sample).
- ``iteration_tokens_total`` is a *histogram* (as in vLLM), so its series are
  ``tailserve:iteration_tokens_total_bucket/_sum/_count``.
- Each ServerMetrics owns its registry: several servers (or tests) in one process must not
  collide in the global ``REGISTRY``.

Routers (the Gateway API Inference Extension's endpoint picker, llm-d, vllm-router) read vLLM's
own names, so the gauges they schedule on are also rendered as ``vllm:`` aliases
(``enable_vllm_metrics``): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` labelled ``model_name`` as vLLM labels them, and the info gauge
``vllm:cache_config_info`` (value 1, the pool's configuration in its labels).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from tailserve.data.records import ABORT_REASONS, EngineState, RequestRecord
from tailserve.data.step import StepStats
from tailserve.obs.config_metrics import ConfigMetrics
from tailserve.obs.memory_metrics import MemoryMetrics
from tailserve.obs.step_model_metrics import StepModelMetrics
from tailserve.obs.tenant_metrics import TenantMetrics

PREFIX = "tailserve:"
VLLM_PREFIX = "vllm:"
# prometheus_client >= 0.22 labels its output "version=1.0.0" (UTF-8 names). Every name here is
# a classic one (letters, digits, "_", ":"), so the body is the 0.0.4 text format byte for byte;
# saying so keeps older scrapers and proxies that check the version happy.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Engine steps and token gaps are milliseconds on a GPU, so the low end is 0.5 ms; roughly
# 1-2-3-5 per decade keeps relative resolution near constant up to 10 s.
FAST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Request-level times include queueing under overload, so they reach minutes.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Prompt/output lengths and step sizes: powers of two, 1 .. 32768.
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(16))

# finish_reason values that count as success; "error" goes to request_errors_total.
SUCCESS_REASONS = ("stop", "length", "abort")
# SLO attainment by part (tailserve_timing's slo: ttft_met, itl_met, tpot_met) and by priority:
# the priority value as given within PRIORITY_LABEL_RANGE, else "other" (a label per value a
# client may send would be unbounded).
SLO_KINDS = ("ttft", "itl", "tpot")
PRIORITY_LABEL_RANGE = range(-3, 4)
REJECT_REASONS = (
    "queue_full", "invalid_request", "draining", "engine_dead", "unauthorized", "too_large",
    "ttft_slo", "ttft_slo_unattainable",
)  # fmt: skip


class _Twin:
    """A ``tailserve:`` gauge and its ``vllm:`` alias set in one call, so the two can never
    disagree (not even at start-up, before the first heartbeat)."""

    def __init__(self, *gauges: Gauge) -> None:
        self._gauges = gauges

    def set(self, value: float) -> None:
        for g in self._gauges:
            g.set(value)


class ServerMetrics:
    """The ``/metrics`` page of one server: feed it engine states, steps and finished requests.

    ``model_name`` labels the ``vllm:`` aliases (a router may select a model's replicas by it);
    ``enable_vllm_metrics=False`` leaves every ``vllm:`` family out.
    """

    def __init__(self, model_name: str = "tailserve", enable_vllm_metrics: bool = True,
                 tenant_names: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self.enable_vllm_metrics = enable_vllm_metrics
        # process_resident_memory_bytes, process_cpu_seconds_total, ... of the API process.
        ProcessCollector(registry=self.registry)
        # Device label for the device_* gauges; EngineState carries it, StepStats does not.
        self._device = "cpu"

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            # prometheus_client appends "_total" itself; pass the stem.
            stem = name.removesuffix("_total")
            return Counter(PREFIX + stem, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        def vllm_gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(VLLM_PREFIX + name, doc, labels, registry=self.registry)

        def routed(name: str, doc: str) -> _Twin:
            # The gauges routers schedule on: ours, plus vLLM's name when asked for.
            ours = gauge(name, doc)
            if not enable_vllm_metrics:
                return _Twin(ours)
            return _Twin(ours, vllm_gauge(name, doc, ("model_name",)).labels(model_name=model_name))

        self.num_requests_running = routed("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = routed(
            "num_requests_waiting", "Requests waiting for admission."
        )
        self.kv_cache_usage_perc = routed(
            "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full; cached blocks free)."
        )
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "Free KV cache blocks.")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV cache blocks in the pool.")
        # What the engine was built as (pool, dtypes, weights, transforms, SLO), set once.
        self.config = ConfigMetrics(gauge, vllm_gauge if enable_vllm_metrics else None)
        # Device, torch allocator and host memory, as the engine reports it (obs/memory.py).
        self.memory_metrics = MemoryMetrics(gauge, counter)

        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(
            "generation_tokens_total", "Generated tokens of finished requests."
        )
        self.request_success = counter(
            "request_success_total", "Finished requests by finish_reason.", ("finished_reason",)
        )
        self.request_errors = counter(
            "request_errors_total", "Failed requests by error type.", ("type",)
        )
        self.request_aborts = counter(
            "request_aborts_total",
            "Engine requests the API ended before the engine finished them, by why.", ("reason",),
        )
        self.num_preemptions = counter("num_preemptions_total", "Preemptions (recompute).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."
        )
        self.requests_rejected = counter(
            "requests_rejected_total", "Requests refused before reaching the engine.", ("reason",)
        )
        # Zero-valued series from the start, so rate() works before the first event.
        for reason in SUCCESS_REASONS:
            self.request_success.labels(finished_reason=reason)
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(reason=reason)
        for reason in ABORT_REASONS:
            self.request_aborts.labels(reason=reason)

        fast, slow, tokens = FAST_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS, TOKEN_BUCKETS
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token (engine clock).", slow
        )
        # Labelled by tenant, the keys file's names bounding the label (obs/tenant_metrics.py).
        self.tenants = TenantMetrics(
            counter, lambda name, doc, buckets, labels: Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry),
            slow, tenant_names)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Gaps between a request's streamed tokens.", fast
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time / (output tokens - 1).",
            fast,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish (engine clock).", slow
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", slow
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Steps spent computing the request's prompt.", slow
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to finish.", slow
        )
        # Structured output's grammar work: each new grammar's compile + first mask in the API
        # process (server/structured.py; a cached grammar is not compiled again, one over
        # --grammar-timeout-ms is observed when it ends), and per constrained request its
        # tailserve_timing.grammar_s (that compile, the engine's matcher build, masks and
        # advances). Unconstrained requests are not observed.
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds", "Compile + first mask of each new grammar.", fast
        )
        self.request_grammar_time = histogram(
            "request_grammar_time_seconds",
            "Per constrained request: its grammar's compile, matcher build and masks.", fast,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output length of finished requests.", tokens
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step (prefill + decode).", tokens
        )
        self.engine_step_seconds = histogram(
            "engine_step_seconds", "Wall time of one engine step.", fast
        )
        # The step-time model's prediction, coefficients and targets (stepcost.py).
        self.step_model = StepModelMetrics(gauge, counter, histogram, fast)
        # Who met the SLO (the server's, or a request's own).
        self.slo_attained = counter(
            "slo_attained_total", "Finished requests that met an SLO, by part (ttft, itl: every "
            "gap, tpot: the mean gap) and priority.", ("slo", "priority"))
        self.slo_missed = counter(
            "slo_missed_total", "Finished requests that missed an SLO, by part and priority.",
            ("slo", "priority"))
        # The newest engine report's gauge values, set on the gauges when the page is
        # rendered (_flush). Every step delivered two reports (its state and its stats) and
        # each set ~25 gauges under prometheus_client's per-value locks: 12% of the API
        # process's CPU on a streamed single request, for values only a scrape reads, and
        # only its last ones. Counters and histograms still take every step as it comes.
        self._load: tuple[int, int, int, int] | None = None
        self._memory: dict[str, float] = {}

    # -- inputs ---------------------------------------------------------------------------------

    def on_ready(self, num_kv_blocks: int) -> None:
        """The engine is up and idle: its pool is known from the resolved configuration, so the
        gauges say so from the first scrape, not only after the first heartbeat (a router that
        scrapes a fresh replica must not read a zero-block pool)."""
        self._set_load(running=0, waiting=0, free_blocks=num_kv_blocks, total_blocks=num_kv_blocks)

    def _set_load(self, *, running: int, waiting: int, free_blocks: int, total_blocks: int) -> None:
        """The queue and pool gauges, from whichever engine report is newest (the Ready
        config, an idle heartbeat's state or a step's stats): kept until the next render."""
        self._load = (running, waiting, free_blocks, total_blocks)

    def _apply_load(self, running: int, waiting: int, free_blocks: int, total_blocks: int) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_free_blocks.set(free_blocks)
        self.kv_cache_total_blocks.set(total_blocks)
        # Reusable prefix-cache blocks count as free. The pool always has a block (the config
        # checks one max_model_len sequence fits), so total_blocks is never 0 here.
        self.kv_cache_usage_perc.set(1.0 - free_blocks / total_blocks if total_blocks else 0.0)

    # Start-up facts, once each (obs/config_metrics.py).
    def on_weights(self, weight_bytes: Mapping[str, int]) -> None:
        self.config.on_weights(weight_bytes)

    def on_transforms(self, transforms: Mapping[str, Mapping[str, int]]) -> None:
        self.config.on_transforms(transforms)

    def on_cache_config(self, *, block_size: int, num_kv_blocks: int,
                        enable_prefix_caching: bool, cache_dtype: str) -> None:
        self.config.on_cache_config(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                    enable_prefix_caching=enable_prefix_caching,
                                    cache_dtype=cache_dtype)

    def on_slo_config(self, *, ttft_s: float | None, itl_s: float | None) -> None:
        self.config.on_slo_config(ttft_s=ttft_s, itl_s=itl_s)

    def on_dtypes(self, *, weight_dtype: str, compute_dtype: str, cache_dtype: str) -> None:
        self.config.on_dtypes(weight_dtype=weight_dtype, compute_dtype=compute_dtype,
                              cache_dtype=cache_dtype)

    def on_engine_state(self, state: EngineState) -> None:
        self._device = state.device
        self._set_load(running=state.num_running, waiting=state.num_waiting,
                       free_blocks=state.free_blocks, total_blocks=state.total_blocks)
        self._memory.update(state.memory)

    def on_step(self, stats: StepStats) -> None:
        self.engine_step_seconds.observe(stats.step_s)
        self.step_model.on_step(stats)
        # A decode sequence contributes exactly one token to the step.
        self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_seqs)
        # StepStats carries per-step deltas, so they add straight into the counters (a zero
        # adds nothing: skipped, as most steps preempt nothing and look nothing up).
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self._set_load(running=stats.num_running, waiting=stats.num_waiting,
                       free_blocks=stats.free_blocks, total_blocks=stats.total_blocks)
        self._memory.update(stats.memory)

    def on_request_finished(self, rec: RequestRecord) -> None:
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.output_tokens)
        if rec.abort_reason is not None:
            self.request_aborts.labels(reason=rec.abort_reason).inc()
        if rec.error_type is not None:
            self.request_errors.labels(type=rec.error_type).inc()
        elif rec.finish_reason in SUCCESS_REASONS:
            self.request_success.labels(finished_reason=rec.finish_reason).inc()
        elif rec.finish_reason == "error":
            # An engine-reported failure without a classified type still has to show up.
            self.request_errors.labels(type="unknown").inc()
        self.tenants.on_request_finished(
            rec, rec.error_type is None and rec.finish_reason in SUCCESS_REASONS)

        timing = rec.timing
        if timing is None:  # never reached the engine: no engine times or lengths to observe
            return
        self._observe(self.time_to_first_token, timing, "ttft_s")
        self._observe(self.e2e_request_latency, timing, "e2e_s")
        self._observe(self.request_queue_time, timing, "queue_s")
        self._observe(self.request_prefill_time, timing, "prefill_s")
        self._observe(self.request_decode_time, timing, "decode_s")
        grammar_s = timing.get("grammar_s")
        if isinstance(grammar_s, (int, float)) and grammar_s > 0:
            self.request_grammar_time.observe(float(grammar_s))
        decode_s = timing.get("decode_s")
        if decode_s is not None and rec.output_tokens > 1:
            # TPOT excludes the first token, whose cost is the prefill (TTFT).
            self.time_per_output_token.observe(decode_s / (rec.output_tokens - 1))
        self.request_prompt_tokens.observe(rec.prompt_tokens)
        self.request_generation_tokens.observe(rec.output_tokens)
        for gap in rec.itl_s:
            self.inter_token_latency.observe(gap)
        slo = timing.get("slo")
        if isinstance(slo, Mapping) and rec.abort_reason != "client_disconnect":
            # A client that left ended it, not the server's latency: not counted.
            p = rec.priority
            priority = str(p) if p in PRIORITY_LABEL_RANGE else "other"
            for kind in SLO_KINDS:
                met = slo.get(f"{kind}_met")
                if met is not None:
                    (self.slo_attained if met else self.slo_missed).labels(
                        slo=kind, priority=priority).inc()

    def on_grammar_compiled(self, seconds: float) -> None:
        self.grammar_compile_time.observe(seconds)

    def on_rejected(self, reason: str, tenant: str | None = None) -> None:
        """``tenant``: who was refused (None: the default tenant); a refusal for a missing
        or wrong key is nobody's."""
        self.requests_rejected.labels(reason=reason).inc()
        if reason != "unauthorized":
            self.tenants.on_rejected(tenant)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for the ``/metrics`` response."""
        self._flush()
        return generate_latest(self.registry), CONTENT_TYPE

    # -- helpers --------------------------------------------------------------------------------

    def _flush(self) -> None:
        """The newest reports' gauge values onto the gauges (render's first act)."""
        if self._load is not None:
            self._apply_load(*self._load)
            self._load = None
        if self._memory:
            self.memory_metrics.set(self._memory, self._device)
            self._memory = {}
        self.step_model.flush()

    @staticmethod
    def _observe(hist: Histogram, timing: Mapping[str, object], key: str) -> None:
        # ttft_s is None for a request that ended before its first token.
        value = timing.get(key)
        if isinstance(value, (int, float)):
            hist.observe(float(value))
