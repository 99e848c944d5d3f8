"""EngineBuilder: start-up, written once, for the engine process, every tensor-parallel worker
and the offline ``LLM``.

Each rank takes the same steps, in this order (``EngineBuilder.steps`` records them; a
tensor-parallel worker also reports each one as its phase, which rank 0 names when start-up
fails):

1. ``load``: the checkpoint, read as ``EngineArgs.resolve_load`` says (packed GGUF blocks or
   dequantized, ``--quantization`` checked against the runner that will serve it), or the one
   the caller hands in as it is (``LLM.from_loaded``).
2. ``resolve``: the arguments against the model: an ``UnsizedEngineConfig``.
3. ``build_runner``: the ``ModelRunner``, whose model ``model/build.py`` builds (this rank's
   shards under tensor parallelism). Under tensor parallelism every rank then waits for all
   the others at the start-up barrier: one that failed fails them all.
4. ``measure`` (CUDA, unless ``num_kv_blocks`` is given): the bytes a profiling forward leaves
   for the KV pool (under tensor parallelism, the smallest of every rank's).
5. ``size``: the frozen ``EngineConfig``, which checks one ``max_model_len`` sequence fits.
6. ``allocate``: the KV pool, once, and (CUDA) the persistent step buffers and decode graphs.

Rank 0 alone then makes the engine's own parts: the KV-events publisher (before the pool, so
that a taken port fails the start before a byte of KV is allocated), the scheduler and the
step-time model's calibration, and wires them into an ``EngineCore``. A serving engine also
hands in llguidance's tokenizer being built in a thread beside steps 1-3 (``grammar_tokenizer``,
``engine/process.py``); it is waited for before the calibration, whose step times a busy
thread would skew.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tailserve.config import EngineArgs, EngineConfig, LoadConfig, UnsizedEngineConfig
from tailserve.config.engine import kv_capacity
from tailserve.engine.calibrate import calibrate
from tailserve.engine.core import EngineCore, open_kv_events
from tailserve.engine.scheduler import Scheduler
from tailserve.model.device import detect_platform
from tailserve.model.loader import LoadedModel, load_model
from tailserve.model.parallel import TensorParallelGroup
from tailserve.model.runner import ModelRunner
from tailserve.platforms import Platform
from tailserve.stepcost import StepShape

log = logging.getLogger(__name__)


class EngineBuilder:
    """The start-up steps of tensor-parallel ``rank`` (0: the engine) over ``args``, resolved
    against ``platform`` (detected when not given). ``report(phase)`` hears each step as it
    starts (a worker writes it where rank 0 reads it)."""

    def __init__(self, args: EngineArgs, platform: Platform | None = None, *, rank: int = 0,
                 report: Callable[[str], None] | None = None) -> None:
        self.args = args
        self.rank = rank
        self.platform = detect_platform() if platform is None else platform
        self.steps: list[str] = []
        self._report = report

    def _step(self, name: str, phase: str) -> None:
        self.steps.append(name)
        log.debug("rank %d start-up step %s: %s", self.rank, name, phase)
        if self._report is not None:
            self._report(phase)

    # ------------------------------------------------------------------ the steps
    def resolve_load(self) -> LoadConfig:
        """What to ask the loader for (``EngineArgs.resolve_load``: ``gguf_weights`` and the
        quantization check against the runner that will serve it)."""
        return self.args.resolve_load(self.platform)

    def load(self, loaded: LoadedModel | None = None, *,
             with_tokenizer: bool = True) -> LoadedModel:
        """``loaded`` when given (weights already in memory), else read from disk."""
        if loaded is not None:
            self._step("load", f"using the model loaded already ({loaded.source})")
            return loaded
        lc = self.resolve_load()
        self._step("load", f"loading the model ({lc.model or 'the bundled GGUF'})")
        return load_model(lc.model, gguf_weights=lc.gguf_weights, quantization=lc.quantization,
                          quantization_group_size=lc.quantization_group_size,
                          with_tokenizer=with_tokenizer)

    def resolve(self, loaded: LoadedModel) -> UnsizedEngineConfig:
        self._step("resolve", "resolving its configuration")
        return self.args.resolve_unsized(loaded.config, self.platform)

    def build_runner(self, loaded: LoadedModel, unsized: UnsizedEngineConfig,
                     tp: TensorParallelGroup | None = None) -> ModelRunner:
        self._step("build_runner", "building its runner" + (" on its shards" if tp else ""))
        return ModelRunner(unsized.model, unsized.runner, unsized.scheduler.max_model_len,
                           loaded.weights, tp=tp)

    def size(self, runner: ModelRunner, unsized: UnsizedEngineConfig) -> EngineConfig:
        """Measure (where the pool is sized by a profiling forward), then size. Under tensor
        parallelism the measurement is a collective: every rank calls this."""
        measured = None
        if unsized.needs_kv_measurement:
            self._step("measure", "measuring its KV cache")
            sc = unsized.scheduler
            measured = runner.profile_kv_cache_bytes(
                sc.max_num_batched_tokens, unsized.block_size, unsized.gpu_memory_utilization,
                sc.max_num_seqs)
        self._step("size", "sizing its KV cache")
        return unsized.sized(measured)

    def allocate(self, runner: ModelRunner, config: EngineConfig) -> None:
        self._step("allocate", "allocating its KV cache")
        runner.allocate_kv_cache(config.cache)
        # CUDA: persistent step inputs and the decode graphs (nothing on CPU).
        runner.prepare_steps(config.scheduler)

    # ------------------------------------------------------------------ rank 0
    def build_engine(self, loaded: LoadedModel | None = None, *, keep_checkpoint: bool = False,
                     with_tokenizer: bool = True,
                     grammar_tokenizer: Future[Any] | None = None) -> EngineCore:
        """Rank 0: every step, the workers started (tensor parallelism), then the engine.
        What it loaded itself it lets go once the runner is built (``release_checkpoint``)
        unless ``keep_checkpoint`` (tools that read ``loaded.weights`` afterwards);
        ``with_tokenizer=False``: no tokenizer in ``loaded`` (the engine process)."""
        t0 = time.perf_counter()
        owned = loaded is None and not keep_checkpoint
        loaded = self.load(loaded, with_tokenizer=with_tokenizer)
        unsized = self.resolve(loaded)
        workers = None
        if self.args.tensor_parallel_size > 1:
            from tailserve.engine.tensor_parallel import TensorParallelWorkers

            workers = TensorParallelWorkers(self.args, unsized)
        try:
            try:
                runner = self.build_runner(loaded, unsized,
                                           workers.group if workers is not None else None)
            except Exception:
                if workers is not None:
                    workers.ready(False)
                raise
            if workers is not None:
                workers.ready(True)
            config = self.size(runner, unsized)
            # First of the engine's own parts: a taken port fails the start before the KV
            # pool is allocated.
            kv_events = open_kv_events(config)
            lltokenizer = _settled(grammar_tokenizer)
            try:
                self.allocate(runner, config)
                scheduler = Scheduler(config.scheduler, config.cache)
                sc = config.scheduler
                calibrate(runner, scheduler.step_model, config.cache.block_size,
                          config.cache.num_kv_blocks, sc.max_num_batched_tokens,
                          sc.max_model_len, sc.max_num_seqs)
            except BaseException:
                if kv_events is not None:
                    kv_events.close()
                raise
            core = EngineCore(config, loaded, runner, scheduler, kv_events, workers, self.steps,
                              grammar_tokenizer=lltokenizer)
        except BaseException:
            if workers is not None:
                workers.shutdown(graceful=False)
            raise
        _log_ready(core, time.perf_counter() - t0)
        return core.release_checkpoint() if owned else core


def _settled(job: Future[Any] | None) -> Any:
    """The tokenizer ``job`` built, or None (none asked for; or it failed: a vocabulary
    llguidance cannot read should not stop the engine, only its constrained requests)."""
    if job is None:
        return None
    t0 = time.perf_counter()
    try:
        tokenizer = job.result()
    except Exception as exc:
        log.warning("structured output: llguidance's tokenizer could not be built (%s: %s); "
                    "constrained requests will try again", type(exc).__name__, str(exc)[:300])
        return None
    log.info("structured output: tokenizer ready (waited %.2f s for it)",
             time.perf_counter() - t0)
    return tokenizer


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _log_ready(core: EngineCore, seconds: float) -> None:
    config = core.config
    sc = config.scheduler
    one = core.scheduler.step_model.predict(StepShape(0, 1, 512, 0))
    log.info("SLO: TTFT %s, ITL %s, TPOT %s (a decode-only step of one request at 512 tokens "
             "of context: %.1f ms predicted)", _ms(sc.slo_ttft_s), _ms(sc.slo_itl_s),
             _ms(sc.slo_tpot_s), one * 1e3)
    cache = config.cache
    run = config.runner
    log.info(
        "engine ready in %.1fs: %s on %s (weights %s, compute %s), %d KV blocks x %d tokens "
        "in %s (%.2f GiB), budget %d",
        seconds, config.model.architecture, run.device, run.dtype, run.compute_dtype,
        cache.num_kv_blocks, cache.block_size, run.kv_cache_dtype,
        cache.kv_cache_bytes / (1 << 30), sc.max_num_batched_tokens,
    )
    capacity = kv_capacity(config)
    if capacity is not None:
        log.info("%s", capacity)
    profile = core.runner.memory_profile
    if profile is not None:
        log.info("%s; CUDA graphs took %.2f GiB", profile.describe(),
                 core.runner.cuda_graph_bytes / (1 << 30))
