"""``EngineArgs``: every argument of an engine, the one dataclass behind the offline
``LLM(**engine_args)`` and the CLI (every field becomes a ``--flag`` of the same name:
``max_num_seqs`` <-> ``--max-num-seqs``), with the checks of what the user gave. Its one
resolution into an ``EngineConfig`` is ``config/resolve.py``'s."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tailserve.config.engine import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ObservabilityConfig,
    PrefixHashAlgo,
    RunnerConfig,
    SchedulerConfig,
    UnsizedEngineConfig,
)
from tailserve.config.load import (
    QUANTIZATIONS,
    RTN_BLOCK,
    LoadConfig,
    check_quantization_group_size,
)
from tailserve.config.model import ModelConfig
from tailserve.config.resolve import (
    DEFAULT_BATCHED_TOKENS,
    resolve_load,
    resolve_runner,
    resolve_unsized,
)
from tailserve.errors import ConfigError
from tailserve.platforms import Platform

# The SLO a request is held to unless it brings its own (docs/slo.md says why these): the first
# token within 1 s, every next one within 100 ms. A reader takes ~4-8 tokens a second, so 100 ms
# a token keeps a stream ahead of a fast reader; a decode step here is ~5-7 ms, so 100 ms leaves
# a step ~90 ms of prefill beside the decodes (~200 prompt tokens), and a 1,000-token prompt's
# idle prefill (~0.5 s) fits the 1 s TTFT with room for a queue.
DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_ITL_MS = 100.0
# What an SLO may be: beyond these the value is a typo (seconds, not milliseconds).
MAX_ITL_SLO_MS = 60_000.0
MAX_TTFT_SLO_MS = 3_600_000.0
# Engine arguments that are gone, and what replaced them (a clear error instead of "unknown").
REMOVED_ENGINE_ARGS: dict[str, str] = {
    "enable_itl_target": "--slo-itl-ms (steps with decodes are sized by the decodes' slack "
                         "under it; --slo-itl-ms none sizes them by tokens alone)",
    "itl_target_ms": "--slo-itl-ms (a per-token deadline, not a per-step target)",
    "itl_target_factor": "--slo-itl-ms (a step may take the smallest slack of its decodes "
                         "under their ITL SLO, not a multiple of a decode step)",
    "itl_target_max_wait_ms": "--slo-ttft-ms (waiting requests go by their TTFT deadline "
                              "with --scheduling-policy deadline)",
    "prefill_step_target_ms": "--slo-itl-ms (a step without decodes is capped by it too)",
    "ttft_slo_ms": "--slo-ttft-ms with --enable-slo-admission",
}


def check_removed_args(names: Iterable[str]) -> None:
    """A ``ConfigError`` naming the replacement of the first removed engine argument."""
    for name in names:
        if name in REMOVED_ENGINE_ARGS:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} ({name}) was removed; use {REMOVED_ENGINE_ARGS[name]}")


def parse_optional_ms(value: str | float | None) -> float | None:
    """A millisecond flag that may be turned off: ``none`` (or ``off``) is None."""
    if value is None or isinstance(value, (int, float)):
        return value
    if value.strip().lower() in ("none", "off"):
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"expected milliseconds or 'none', got {value!r}") from None


# EngineArgs.dtype's and kv_cache_dtype's choices (auto resolves against the platform).
DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class EngineArgs:
    """Everything that configures an engine. Field names are the CLI flag names. A default that
    a resolved part also has is read from that part (``SchedulerConfig.max_queue_len`` ...), so
    each is written once; the exceptions differ on purpose: ``scheduling_policy`` (served
    ``deadline``; a bare ``SchedulerConfig``, as the exact scheduler tests build it, is
    ``fcfs``) and the SLOs (the server holds requests to ``DEFAULT_SLO_*_MS``; a bare
    ``SchedulerConfig`` to none)."""

    model: str | None = field(
        default=None, metadata={"help": "HF folder or .gguf file; default: bundled SmolLM2-135M"}
    )
    dtype: DtypeChoice = field(
        default="auto", metadata={"help": "the dtype weights are stored in (CPU kernels compute "
                                  "in float32 whatever it is); auto: a 16-bit checkpoint's own "
                                  "on CPU, bfloat16 on GPUs that have it"}
    )
    kv_cache_dtype: DtypeChoice = field(
        default="auto", metadata={"help": "the dtype of the KV cache; auto: the activations' "
                                  "dtype; a 16-bit cache holds twice the tokens and halves "
                                  "what attention reads"}
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gguf_weights: Literal["auto", "packed", "dequantize"] = field(
        default="auto",
        metadata={"help": "a GGUF's quantized matrices: packed keeps their blocks as stored "
                  "for the CPU kernels (float32 CPU only); dequantize expands them to float32 "
                  "(the reference); auto: packed where it can run"},
    )
    quantization: Literal["int8", "int4"] | None = field(
        default=None,
        metadata={"help": "weight-only quantization of a float (HF) checkpoint as it loads, "
                  "group-wise round-to-nearest into the packed GGUF kernels' blocks: int8 = "
                  "Q8_0 (8.5 bits a weight), int4 = Q4_1 (5 bits); embeddings and LM head "
                  "Q8_0 (float32 CPU only)"},
    )
    quantization_group_size: int = field(
        default=RTN_BLOCK,
        metadata={"help": "values sharing one scale under --quantization: a multiple of 32, "
                  "or -1 for one per row; a group over 32 is stored as 32-value blocks that "
                  "repeat its scale (the same bytes as 32, less accuracy)"},
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output; default: the model's context"}
    )
    max_num_seqs: int = field(default=64, metadata={"help": "requests running at once"})
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "token budget per step; default "
                                f"{DEFAULT_BATCHED_TOKENS['cpu']} on CPU, "
                                f"{DEFAULT_BATCHED_TOKENS['cuda']} on GPU"}
    )
    block_size: int = 16
    kv_cache_memory: float = field(
        default=2.0, metadata={"help": "GiB of KV cache on CPU"}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "fraction of GPU memory for weights + activations + KV"}
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "override the computed number of KV blocks (a model "
                                "with sliding-window layers: blocks of its KV cache groups' "
                                "layers_per_block layers, see the start-up log)"}
    )
    watermark: float = field(
        default=CacheConfig.watermark,
        metadata={"help": "fraction of KV blocks that admitting a new request must leave free"},
    )
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    prefix_caching_hash_algo: PrefixHashAlgo = field(
        default=CacheConfig.prefix_caching_hash_algo,
        metadata={"help": "how prefix caching keys full KV blocks: sha256 (a collision-resistant "
                  "chain) or xxh64 (faster; only where every client is trusted)"},
    )
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    long_prefill_token_threshold: int | None = field(
        default=SchedulerConfig.long_prefill_token_threshold,
        metadata={"help": "most prompt tokens one request may take in one step"},
    )
    admission_policy: Literal["optimistic", "reserve"] = SchedulerConfig.admission_policy
    scheduling_policy: Literal["fcfs", "priority", "deadline"] = field(
        default="deadline",
        metadata={"help": "the order of the prefill budget: deadline: earliest TTFT deadline "
                  "first (a request that can no longer meet it yields to those that can), "
                  "preemption by slack; fcfs: by --prefill-scheduling; priority: the lowest "
                  "priority value first, then as fcfs"},
    )
    slo_ttft_ms: float = field(
        default=DEFAULT_SLO_TTFT_MS,
        metadata={"help": "time to first token each request is held to unless it brings its "
                  "own (header x-slo-ttft-ms, body slo.ttft_ms), ms"},
    )
    slo_itl_ms: float | None = field(
        default=DEFAULT_SLO_ITL_MS,
        metadata={"help": "the most any gap between two of a request's tokens may take, ms "
                  "(x-slo-itl-ms, slo.itl_ms): each step may take the smallest slack of the "
                  "decodes it carries, and prefill the rest; 'none': steps are sized by "
                  "tokens alone", "parse": parse_optional_ms, "metavar": "MS"},
    )
    slo_tpot_ms: float | None = field(
        default=None,
        metadata={"help": "the mean gap after the first token each request is held to, ms "
                  "(x-slo-tpot-ms, slo.tpot_ms); reported per request, not scheduled on",
                  "parse": parse_optional_ms, "metavar": "MS"},
    )
    enable_slo_admission: bool = field(
        default=SchedulerConfig.enable_slo_admission,
        metadata={"help": "refuse (429 with Retry-After) a request predicted to miss its TTFT "
                  "SLO, and (400) one that would miss it even on an idle engine"},
    )
    prefill_scheduling: Literal["srpt", "fcfs"] = field(
        default=SchedulerConfig.prefill_scheduling,
        metadata={"help": "srpt: the prefill budget goes first to the request with the "
                  "fewest prompt tokens left, with aging; fcfs: in arrival order"},
    )
    prefill_aging_s_per_1k_tokens: float = field(
        default=SchedulerConfig.prefill_aging_s_per_token * 1e3,
        metadata={"help": "SRPT aging: a prompt's place is its arrival + this x its remaining "
                  "tokens / 1000; no request that arrives later than that passes it"},
    )
    max_num_partial_prefills: int = field(
        default=SchedulerConfig.max_num_partial_prefills,
        metadata={"help": "requests part-way through a chunked prefill at once"}
    )
    max_long_partial_prefills: int = field(
        default=SchedulerConfig.max_long_partial_prefills,
        metadata={"help": "of those, prompts longer than the token budget (or "
                  "--long-prefill-token-threshold): fewer than --max-num-partial-prefills "
                  "lets short prompts start beside a long one instead of queueing behind it"},
    )
    seed: int = RunnerConfig.seed
    max_queue_len: int | None = field(
        default=SchedulerConfig.max_queue_len,
        metadata={"help": "waiting requests beyond which new ones are rejected"},
    )
    max_request_tokens: int | None = field(
        default=SchedulerConfig.max_request_tokens,
        metadata={"help": "most tokens one request may ask for, n x (prompt + max_tokens); "
                  "default: the KV pool's total (num_kv_blocks x block_size; with sliding-window "
                  "layers at least as many max_model_len sequences as fit)"},
    )
    kv_events_config: str | dict[str, Any] | None = field(
        default=None,
        metadata={"help": "publish prefix-cache events in vLLM's format, a JSON object as "
                  "vLLM takes it, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": "
                  "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}'",
                  "metavar": "JSON"},
    )
    tensor_parallel_size: int = field(
        default=RunnerConfig.tensor_parallel_size,
        metadata={"help": "split every layer over this many ranks (one process each, "
                  "torch.distributed: gloo on CPU, NCCL on CUDA); must divide the attention "
                  "and KV heads; the CPU threads are split between the ranks"},
    )
    enforce_eager: bool = field(
        default=RunnerConfig.enforce_eager,
        metadata={"help": "run every step through the PyTorch module forward; by default "
                  "decode-only steps replay a CUDA graph captured at start-up (CUDA) or run all "
                  "layers in one compiled call (CPU)"},
    )
    memory_alert: float = field(
        default=ObservabilityConfig.memory_alert,
        metadata={"help": "warn (and count tailserve:memory_alerts_total) when device memory "
                  "(host RAM on CPU) in use passes this fraction"},
    )
    assert_steady_memory: bool = field(
        default=ObservabilityConfig.assert_steady_memory,
        metadata={"help": "after warm-up, warn (and count tailserve:steady_memory_violations_"
                  "total) when torch reserved (CUDA) or RSS + KV pool (CPU) grows with traffic"},
    )
    steady_memory_tolerance: float = field(
        default=ObservabilityConfig.steady_memory_tolerance,
        metadata={"help": "MiB of growth --assert-steady-memory allows"}
    )
    steady_memory_warmup: int = field(
        default=ObservabilityConfig.steady_memory_warmup,
        metadata={"help": "finished requests before --assert-steady-memory's "
                              "baseline is taken"}
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be int8 or int4, got {self.quantization!r}")
        check_quantization_group_size(self.quantization_group_size)
        if self.quantization is not None and self.dtype in ("bfloat16", "float16"):
            raise ConfigError(
                f"--quantization {self.quantization} stores the matrices as blocks and the rest "
                f"in float32 on the CPU kernels; --dtype {self.dtype} cannot go with it (leave "
                "--dtype auto or float32)")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 1, "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.max_request_tokens is not None and self.max_request_tokens < 2:
            raise ConfigError(
                f"max_request_tokens must be >= 2 (one prompt and one output token), got "
                f"{self.max_request_tokens}"
            )
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ConfigError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        KVEventsConfig.parse(self.kv_events_config)
        for name, value, top in (("slo_ttft_ms", self.slo_ttft_ms, MAX_TTFT_SLO_MS),
                                 ("slo_itl_ms", self.slo_itl_ms, MAX_ITL_SLO_MS),
                                 ("slo_tpot_ms", self.slo_tpot_ms, MAX_ITL_SLO_MS)):
            # ``not a < v <= b`` also catches NaN.
            if value is not None and not (isinstance(value, (int, float))
                                          and 0.0 < value <= top):
                raise ConfigError(f"{name} must be in (0, {top:.0f}] ms, got {value!r}")
        if not 0.0 < self.prefill_aging_s_per_1k_tokens <= 3600.0:
            raise ConfigError("prefill_aging_s_per_1k_tokens must be in (0, 3600] s, got "
                              f"{self.prefill_aging_s_per_1k_tokens}")
        # Above max_num_seqs it means no limit of its own (the default, 4, with a smaller
        # max_num_seqs): not a mistake to refuse.
        if self.max_num_partial_prefills < 1:
            raise ConfigError(
                f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}"
            )
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ConfigError(
                "max_long_partial_prefills must be in [1, max_num_partial_prefills="
                f"{self.max_num_partial_prefills}], got {self.max_long_partial_prefills}"
            )
        if not 0.0 < self.memory_alert <= 1.0:
            raise ConfigError(f"memory_alert must be in (0, 1], got {self.memory_alert}")
        if self.steady_memory_tolerance < 0 or self.steady_memory_warmup < 0:
            raise ConfigError(
                "steady_memory_tolerance and steady_memory_warmup must be >= 0, got "
                f"{self.steady_memory_tolerance} and {self.steady_memory_warmup}"
            )

    def resolve(
        self, model: ModelConfig, platform: Platform, kv_cache_bytes: int | None = None
    ) -> EngineConfig:
        """The one resolution of these arguments against a model: a frozen ``EngineConfig``.

        ``kv_cache_bytes`` is the memory the KV pool may take where it has to be measured
        (CUDA, see ``resolve_unsized``); on CPU it comes from ``kv_cache_memory``.
        """
        return self.resolve_unsized(model, platform).sized(kv_cache_bytes)

    def resolve_unsized(self, model: ModelConfig, platform: Platform) -> UnsizedEngineConfig:
        """Everything but the KV pool's size, which on CUDA needs a profiling forward of the
        model built with this configuration (``UnsizedEngineConfig.needs_kv_measurement``)."""
        return resolve_unsized(self, model, platform)

    def resolve_load(self, platform: Platform) -> LoadConfig:
        """What the loader is asked for, before the model is read."""
        return resolve_load(self, platform)

    def resolve_runner(
        self, platform: Platform, checkpoint_dtype: str | None = None
    ) -> RunnerConfig:
        """Device and dtypes resolved from ``auto`` (``checkpoint_dtype``: what the checkpoint
        stores, if known)."""
        return resolve_runner(self, platform, checkpoint_dtype)
