"""Configuration: ``ModelConfig`` (what the weights are) and ``EngineArgs`` (how to serve them).

``EngineArgs`` is the one dataclass behind the offline ``LLM(**engine_args)`` and the CLI: every
field becomes a ``--flag`` of the same name (``max_num_seqs`` ⇄ ``--max-num-seqs``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from tailserve.errors import ConfigError, ModelLoadError
from tailserve.families import FAMILIES
from tailserve.model_features import (
    hidden_act,
    sliding_window,
    sliding_window_layers,
    unsupported_features,
)
from tailserve.platforms import (
    DeviceType,
    Platform,
    ServingDtype,
    compute_dtype,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from tailserve.request import RequestLimits

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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
# Default token budget per step (max_num_batched_tokens) by device type.
DEFAULT_BATCHED_TOKENS: dict[DeviceType, int] = {"cpu": 512, "cuda": 4096}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, independent of where its weights came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Qwen3's RMSNorm over each head of q and k before rope (families/qwen3.py).
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The dtype the checkpoint stores its weights in (config.json's torch_dtype); None where
    # the loader produces float32 (GGUF). ``dtype=auto`` keeps a 16-bit one on CPU.
    checkpoint_dtype: str | None = None
    # The window of the checkpoint's sliding-window layers (None: every layer is global) and
    # which layers slide: a token there attends to the last ``sliding_window`` positions only.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation (model_features.SERVED_ACTIVATIONS)
    # The families' declarations (families/base.py), resolved for this checkpoint.
    sandwich_norms: bool = False
    embedding_scale: float | None = None  # token embeddings times this (Gemma: sqrt(hidden))
    rope_local_theta: float | None = None  # the sliding layers' own rope base (Gemma 3)
    # The attention scale is query_pre_attn_scalar ** -0.5 where set (Gemma), else
    # head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends within, or None where it attends to everything."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    @property
    def attention_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5  # as transformers' Gemma computes
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; unsupported models fail here."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} (model_type={cfg.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = FAMILIES[arch]
        unsupported = unsupported_features(cfg)
        if unsupported:
            raise ModelLoadError(
                f"the {arch} checkpoint asks for what tailserve's decoder does not serve: "
                f"{', '.join(unsupported)}"
            )
        rope_scaling = cfg.get("rope_scaling") or None
        # transformers >= 4.45 nests rope settings under rope_parameters in some exports, and
        # per layer type where the types have their own (Gemma 3).
        rope_params = cfg.get("rope_parameters") or {}
        local_params = rope_params.get("sliding_attention") or {}
        rope_params = rope_params.get("full_attention", rope_params)
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        local_theta = cfg.get("rope_local_base_freq",
                              local_params.get("rope_theta", family.local_rope_theta))
        if local_params.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope scaling on sliding-window layers is not served: "
                                 f"rope_parameters.sliding_attention={local_params!r}")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelLoadError(
                    f"unsupported rope_scaling type {rope_type!r}; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            rope_scaling = {**rope_scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        window_layers = sliding_window_layers(cfg, family.sliding_window_pattern)
        softcap = cfg.get("final_logit_softcapping")
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tie_word_embeddings)),
            attention_bias=bool(cfg.get("attention_bias") if cfg.get("attention_bias")
                                is not None else family.attention_bias),
            qk_norm=family.qk_norm,
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=sliding_window(cfg) if window_layers else None,
            sliding_window_layers=window_layers,
            hidden_act=hidden_act(cfg, family.hidden_act),
            sandwich_norms=family.sandwich_norms,
            embedding_scale=float(hidden) ** 0.5 if family.scale_embeddings else None,
            rope_local_theta=None if local_theta is None else float(local_theta),
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )


# --quantization's blocks: Q8_0 / Q4_1 hold 32 values each; a group is a whole number of them.
RTN_BLOCK = 32
QUANTIZATIONS = ("int8", "int4")  # EngineArgs.quantization's choices
# EngineArgs.dtype's and kv_cache_dtype's choices (auto resolves against the platform).
DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
# How full KV blocks are keyed for prefix caching (kv.block_pool.HashAlgo, which this layer
# cannot import: the same two values).
PrefixHashAlgo = Literal["sha256", "xxh64"]


def check_quantization_group_size(group_size: int) -> None:
    """A group of ``--quantization-group-size`` values shares one scale (and minimum): a
    multiple of the 32-value blocks the kernels read, or -1 for one group per row."""
    if group_size != -1 and (group_size < RTN_BLOCK or group_size % RTN_BLOCK):
        raise ConfigError(
            f"quantization_group_size must be a positive multiple of {RTN_BLOCK} (the blocks "
            f"the kernels read) or -1 (one group per row), got {group_size}")


GGUF_WEIGHTS = ("auto", "packed", "dequantize")  # EngineArgs.gguf_weights's choices


def packed_weights_supported(device: str, dtype: str, cpu_kernels: bool) -> bool:
    """Whether a runner on ``device`` / ``dtype`` can serve packed blocks (a GGUF's, or
    ``--quantization``'s): float32 on CPU with the compiled kernels, the only ones that read
    them (``cpu_kernels``: ``Platform.cpu_kernels``)."""
    return device == "cpu" and dtype == "float32" and cpu_kernels


def _runs_on(device: str, dtype: str, cpu_kernels: bool) -> str:
    return f"this engine runs {dtype} on {device}" + (
        " without the kernels" if device == "cpu" and dtype == "float32" and not cpu_kernels
        else "")


def resolve_gguf_weights(choice: str, device: str, dtype: str, cpu_kernels: bool,
                         tensor_parallel_size: int = 1) -> Literal["packed", "dequantize"]:
    """``--gguf-weights`` to what the loader does: ``auto`` is packed where it can be served
    (faster and ~5x less memory on the bundled model, benchmarks/notes/weights.md), else
    dequantized; under tensor parallelism ``auto`` dequantizes, since a split of packed
    blocks must fall on block boundaries (model/transforms/tensor_parallel.py), which only the
    checkpoint's formats decide (``packed`` asks for it and fails with the numbers where a
    rank's share is not whole blocks). ``packed`` where it cannot be served is a
    ``ModelLoadError``."""
    if choice not in GGUF_WEIGHTS:
        raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}, got {choice!r}")
    supported = packed_weights_supported(device, dtype, cpu_kernels)
    if choice == "packed" and not supported:
        raise ModelLoadError(
            "gguf_weights='packed' needs the compiled CPU kernels on a float32 CPU runner; "
            + _runs_on(device, dtype, cpu_kernels))
    if choice == "auto":
        return "packed" if supported and tensor_parallel_size == 1 else "dequantize"
    return "packed" if choice == "packed" else "dequantize"


def check_quantization_supported(quantization: str | None, device: str, dtype: str,
                                 cpu_kernels: bool) -> None:
    """``--quantization`` stores blocks only the packed kernels read: a float32 CPU runner
    with the compiled kernels (``dtype`` auto resolves to float32 with it)."""
    if quantization is not None and not packed_weights_supported(device, dtype, cpu_kernels):
        raise ModelLoadError(
            f"--quantization {quantization} needs the compiled CPU kernels on a float32 CPU "
            "runner (they read its blocks); " + _runs_on(device, dtype, cpu_kernels))


@dataclass(frozen=True)
class LoadConfig:
    """How the checkpoint is read (``EngineArgs.resolve_load``): ``gguf_weights`` resolved
    from ``auto``, ``quantization`` checked against the runner that will serve it."""

    model: str | None
    gguf_weights: Literal["packed", "dequantize"]
    quantization: Literal["int8", "int4"] | None
    quantization_group_size: int


@dataclass
class EngineArgs:
    """Everything that configures an engine. Field names are the CLI flag names."""

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
        default=None, metadata={"help": "override the computed number of KV blocks"}
    )
    watermark: float = field(
        default=0.05,
        metadata={"help": "fraction of KV blocks that admitting a new request must leave free"},
    )
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: PrefixHashAlgo = field(
        default="sha256", metadata={"help": "how prefix caching keys full KV blocks: sha256 "
                                    "(a collision-resistant chain) or xxh64 (faster; only "
                                    "where every client is trusted)"},
    )
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = field(
        default=None, metadata={"help": "most prompt tokens one request may take in one step"}
    )
    admission_policy: Literal["optimistic", "reserve"] = "optimistic"
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
        default=False,
        metadata={"help": "refuse (429 with Retry-After) a request predicted to miss its TTFT "
                  "SLO, and (400) one that would miss it even on an idle engine"},
    )
    prefill_scheduling: Literal["srpt", "fcfs"] = field(
        default="srpt",
        metadata={"help": "srpt: the prefill budget goes first to the request with the "
                  "fewest prompt tokens left, with aging; fcfs: in arrival order"},
    )
    prefill_aging_s_per_1k_tokens: float = field(
        default=2.0,
        metadata={"help": "SRPT aging: a prompt's place is its arrival + this x its remaining "
                  "tokens / 1000; no request that arrives later than that passes it"},
    )
    max_num_partial_prefills: int = field(
        default=4, metadata={"help": "requests part-way through a chunked prefill at once"}
    )
    max_long_partial_prefills: int = field(
        default=1,
        metadata={"help": "of those, prompts longer than the token budget (or "
                  "--long-prefill-token-threshold): fewer than --max-num-partial-prefills "
                  "lets short prompts start beside a long one instead of queueing behind it"},
    )
    seed: int = 0
    max_queue_len: int | None = field(
        default=None, metadata={"help": "waiting requests beyond which new ones are rejected"}
    )
    max_request_tokens: int | None = field(
        default=None,
        metadata={"help": "most tokens one request may ask for, n x (prompt + max_tokens); "
                  "default: the KV pool's total (num_kv_blocks x block_size)"},
    )
    kv_events_config: str | dict[str, Any] | None = field(
        default=None,
        metadata={"help": "publish prefix-cache events in vLLM's format, a JSON object as "
                  "vLLM takes it, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": "
                  "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}'",
                  "metavar": "JSON"},
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "split every layer over this many ranks (one process each, "
                  "torch.distributed: gloo on CPU, NCCL on CUDA); must divide the attention "
                  "and KV heads; the CPU threads are split between the ranks"},
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "run every step through the PyTorch module forward; by default "
                  "decode-only steps replay a CUDA graph captured at start-up (CUDA) or run all "
                  "layers in one compiled call (CPU)"},
    )
    memory_alert: float = field(
        default=0.95,
        metadata={"help": "warn (and count tailserve:memory_alerts_total) when device memory "
                  "(host RAM on CPU) in use passes this fraction"},
    )
    assert_steady_memory: bool = field(
        default=False,
        metadata={"help": "after warm-up, warn (and count tailserve:steady_memory_violations_"
                  "total) when torch reserved (CUDA) or RSS + KV pool (CPU) grows with traffic"},
    )
    steady_memory_tolerance: float = field(
        default=64.0, metadata={"help": "MiB of growth --assert-steady-memory allows"}
    )
    steady_memory_warmup: int = field(
        default=32, metadata={"help": "finished requests before --assert-steady-memory's "
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
        runner = self.resolve_runner(platform, model.checkpoint_dtype)
        max_model_len = resolve_max_model_len(self.max_model_len, model,
                                              sliding_window_served(runner.device))
        check_tensor_parallel(model, self.tensor_parallel_size)
        budget = self.max_num_batched_tokens
        if budget is None:
            # The default must hold every running decode, and whole prompts when not chunking.
            budget = max(DEFAULT_BATCHED_TOKENS[runner.device], self.max_num_seqs)
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            admission_policy=self.admission_policy,
            scheduling_policy=self.scheduling_policy,
            max_queue_len=self.max_queue_len,
            max_request_tokens=self.max_request_tokens,
            slo_ttft_s=self.slo_ttft_ms / 1e3,
            slo_itl_s=None if self.slo_itl_ms is None else self.slo_itl_ms / 1e3,
            slo_tpot_s=None if self.slo_tpot_ms is None else self.slo_tpot_ms / 1e3,
            enable_slo_admission=self.enable_slo_admission,
            prefill_scheduling=self.prefill_scheduling,
            prefill_aging_s_per_token=self.prefill_aging_s_per_1k_tokens / 1e3,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
        )
        observability = ObservabilityConfig(
            memory_alert=self.memory_alert,
            assert_steady_memory=self.assert_steady_memory,
            steady_memory_tolerance=self.steady_memory_tolerance,
            steady_memory_warmup=self.steady_memory_warmup,
        )
        kv_events = KVEventsConfig.parse(self.kv_events_config)
        # CPU: the pool is given in GiB; CUDA: whatever the profiling forward leaves.
        kv_bytes = None if runner.device == "cuda" else int(self.kv_cache_memory * (1 << 30))
        return UnsizedEngineConfig(
            model=model,
            runner=runner,
            scheduler=scheduler,
            observability=observability,
            block_size=self.block_size,
            block_bytes=kv_block_bytes(model, self.block_size, runner.kv_cache_dtype,
                                       runner.tensor_parallel_size),
            watermark=self.watermark,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=kv_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_events=kv_events,
        )

    def resolve_load(self, platform: Platform) -> LoadConfig:
        """What the loader is asked for, before the model is read (its checkpoint dtype
        unknown yet: a 16-bit checkpoint neither packs nor quantizes, float32 decides)."""
        runner = self.resolve_runner(platform)
        check_quantization_supported(self.quantization, runner.device, runner.dtype,
                                     platform.cpu_kernels)
        gguf = resolve_gguf_weights(self.gguf_weights, runner.device, runner.dtype,
                                    platform.cpu_kernels, self.tensor_parallel_size)
        return LoadConfig(self.model, gguf, self.quantization, self.quantization_group_size)

    def resolve_runner(
        self, platform: Platform, checkpoint_dtype: str | None = None
    ) -> RunnerConfig:
        """Device and dtypes resolved from ``auto`` (the loader needs the device and the weight
        dtype before the model; ``checkpoint_dtype`` is what the checkpoint stores, if known)."""
        device = resolve_device(self.device, platform)
        if self.quantization is not None:  # blocks + float32: what the packed kernels serve
            checkpoint_dtype = None
        weights = resolve_dtype(self.dtype, device, platform, checkpoint_dtype)
        compute = compute_dtype(weights, device, platform)
        return RunnerConfig(
            device=device,
            dtype=weights,
            compute_dtype=compute,
            kv_cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, compute),
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
        )


DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_tensor_parallel(model: ModelConfig, tensor_parallel_size: int) -> None:
    """Each rank takes whole attention heads, whole KV heads and an equal share of the MLP."""
    tp = tensor_parallel_size
    if tp == 1:
        return
    parts = (("attention heads", model.num_attention_heads),
             ("KV heads", model.num_key_value_heads),
             ("intermediate size", model.intermediate_size))
    bad = [f"{n} {what}" for what, n in parts if n % tp]
    if bad:
        raise ConfigError(
            f"--tensor-parallel-size {tp} does not divide the model's "
            f"{model.num_attention_heads} attention heads and {model.num_key_value_heads} KV "
            f"heads (intermediate size {model.intermediate_size}): {', '.join(bad)} cannot be "
            f"split in {tp}; use a size that divides them"
        )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape of one tensor-parallel rank's model (``check_tensor_parallel`` has to pass):
    heads, KV heads and intermediate size divided by ``world_size``, ``head_dim`` kept. The
    runner builds a rank's model from it, ``tailserve plan`` counts a device's weights by it."""
    check_tensor_parallel(cfg, world_size)
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=cfg.num_key_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
        head_dim=cfg.head_dim,  # explicit already; a rank's hidden // heads would differ
    )


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: float, tensor_parallel_size: int = 1
                       ) -> int:
    """KV bytes one token takes on one rank: 2 (K and V) x layers x the rank's KV heads x
    head_dim x bytes. The one formula behind the pool's blocks and ``tailserve plan``."""
    heads = math.ceil(model.num_key_value_heads / tensor_parallel_size)
    return int(2 * model.num_hidden_layers * heads * model.head_dim * dtype_bytes)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: str,
                   tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block on one rank: K and V of ``block_size`` tokens in every layer."""
    return block_size * kv_bytes_per_token(model, DTYPE_BYTES[dtype], tensor_parallel_size)


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runner runs: device and dtypes resolved from ``auto`` to what is used.

    Three dtypes, each for what it stores: ``dtype`` the weights of the matmuls and the
    embedding table (the ``dtype`` argument), ``compute_dtype`` the activations (and norms,
    biases), ``kv_cache_dtype`` the KV pool. On CPU with the compiled kernels compute is
    float32 and 16-bit weights are widened in registers; elsewhere the first two are equal.
    """

    device: DeviceType
    dtype: ServingDtype  # weights as stored
    compute_dtype: ServingDtype = "float32"
    kv_cache_dtype: ServingDtype = "float32"
    seed: int = 0  # the sampler's generator for requests without their own seed
    enforce_eager: bool = False
    tensor_parallel_size: int = 1  # ranks the layers are split over (one process each)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: its shape (the runner allocates it) and its admission rules (the
    block manager inside the scheduler applies them)."""

    block_size: int
    num_kv_blocks: int
    block_bytes: int  # one block, all layers, K and V, in RunnerConfig.kv_cache_dtype
    watermark: float = 0.05
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False  # the block pool records what it caches and evicts
    prefix_caching_hash_algo: PrefixHashAlgo = "sha256"

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.block_bytes


@dataclass(frozen=True)
class SchedulerConfig:
    """What the torch-free scheduler decides with (the pool's size is in ``CacheConfig``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    admission_policy: Literal["optimistic", "reserve"] = "optimistic"
    scheduling_policy: Literal["fcfs", "priority", "deadline"] = "fcfs"
    max_queue_len: int | None = None
    # None: the pool's total tokens (CacheConfig), see ``request_limits``.
    max_request_tokens: int | None = None
    # The SLO of a request that brings none (None: not held to that part). slo_itl_s sizes
    # the steps (engine/latency.py step_time_budget); None: by tokens alone.
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    slo_tpot_s: float | None = None
    enable_slo_admission: bool = False
    prefill_scheduling: Literal["srpt", "fcfs"] = "srpt"
    prefill_aging_s_per_token: float = 2e-3
    max_num_partial_prefills: int = 4
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running decode fits one step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with chunked prefill disabled, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


def sliding_window_served(device: str) -> bool:
    """Whether attention within a sliding window is served on ``device``: by the torch
    reference and the CPU kernels' backends, not yet by the Triton (CUDA) one."""
    return device != "cuda"


def resolve_max_model_len(asked: int | None, model: ModelConfig,
                          window_served: bool = True) -> int:
    """``--max-model-len`` against the model: at most its context length, and, where attention
    within a sliding window is not served (``window_served`` False: CUDA), at most the window.
    Up to the window a sliding-window layer attends to every earlier token, as a global one
    does, so the answers are the checkpoint's own; past it they would silently be another
    model's. Asked for more than the window there: refused; left to default: capped, with a
    warning that says so."""
    limit = model.max_position_embeddings
    if asked is not None and asked > limit:
        raise ConfigError(
            f"max_model_len ({asked}) exceeds the model's context length ({limit})"
        )
    window = model.sliding_window
    if window_served or window is None or window >= (asked or limit):
        return asked or limit
    if asked is not None:
        raise ConfigError(
            f"max_model_len ({asked}) exceeds the model's sliding attention window ({window} "
            f"tokens): attention past the window is not served on this device yet, so a longer "
            f"sequence would get another model's answers; set --max-model-len {window} or less"
        )
    log.warning(
        "the model attends within a sliding window of %d tokens, and attention past the window "
        "is not served on this device yet: max_model_len capped at %d (the model's context "
        "length is %d)", window, window, limit,
    )
    return window


def check_pool_fits(scheduler: SchedulerConfig, cache: CacheConfig) -> None:
    """One max_model_len sequence must fit the pool, or a long request could wait forever."""
    blocks_per_seq = -(-scheduler.max_model_len // cache.block_size)
    if blocks_per_seq > cache.num_kv_blocks:
        raise ConfigError(
            f"one max_model_len={scheduler.max_model_len} sequence needs {blocks_per_seq} KV "
            f"blocks of {cache.block_size} tokens but the pool has {cache.num_kv_blocks}; raise "
            f"kv_cache_memory / num_kv_blocks or lower max_model_len"
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """Where prefix-cache events go (``--kv-events-config``): vLLM's ``KVEventsConfig``
    fields, names, defaults and meaning, so one JSON string configures either server."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null"
    # ZMQ PUB address; bound when it has "*", "::", ipc:// or inproc://, else connected to.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER address that resends buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)
    # Accepted as vLLM spells it; tailserve sends from the step loop and queues nothing.
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Events are recorded and sent (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> KVEventsConfig | None:
        """From the flag's JSON text (or a dict); ``ConfigError`` naming what is wrong."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"kv_events_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        cfg = cls(**value)
        publisher = cfg.publisher or ("zmq" if cfg.enable_kv_cache_events else "null")
        if publisher not in ("null", "zmq"):
            raise ConfigError(f"kv_events_config publisher must be 'null' or 'zmq', got "
                              f"{publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 0:
                raise ConfigError(f"kv_events_config {name} must be an integer >= 0, got "
                                  f"{getattr(cfg, name)!r}")
        if not isinstance(cfg.endpoint, str) or not isinstance(cfg.topic, str):
            raise ConfigError("kv_events_config endpoint and topic must be strings")
        return cls(**{**value, "publisher": publisher})


@dataclass(frozen=True)
class ObservabilityConfig:
    """The engine's own memory checks (obs/memory.py)."""

    memory_alert: float = 0.95
    assert_steady_memory: bool = False
    steady_memory_tolerance: float = 64.0  # MiB
    steady_memory_warmup: int = 32


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine, resolved once (``EngineArgs.resolve``); the engine's
    ``Ready`` message carries it to the API process."""

    model: ModelConfig
    runner: RunnerConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    observability: ObservabilityConfig
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        # Checked here so that a pool too small fails before a byte of KV is allocated.
        check_pool_fits(self.scheduler, self.cache)

    @property
    def request_limits(self) -> RequestLimits:
        """What one request may be (vocabulary, lengths, pool): the input processor's checks."""
        return RequestLimits(
            vocab_size=self.model.vocab_size, max_model_len=self.scheduler.max_model_len,
            block_size=self.cache.block_size, num_kv_blocks=self.cache.num_kv_blocks,
            max_request_tokens=max_request_tokens(self.scheduler, self.cache),
        )


def max_request_tokens(scheduler: SchedulerConfig, cache: CacheConfig) -> int:
    """The per-request token cap: the user's, else every token the pool holds."""
    if scheduler.max_request_tokens is not None:
        return scheduler.max_request_tokens
    return cache.num_kv_blocks * cache.block_size


@dataclass(frozen=True)
class UnsizedEngineConfig:
    """An ``EngineConfig`` but for the KV pool's size, which on CUDA depends on a profiling
    forward of the model built from ``model``, ``runner`` and ``scheduler`` (see
    ``ModelRunner.profile_kv_cache_bytes``). ``sized`` finishes the resolution."""

    model: ModelConfig
    runner: RunnerConfig
    scheduler: SchedulerConfig
    observability: ObservabilityConfig
    block_size: int
    block_bytes: int
    watermark: float
    enable_prefix_caching: bool
    prefix_caching_hash_algo: PrefixHashAlgo
    num_kv_blocks: int | None  # the user's override, which makes any measurement moot
    kv_cache_bytes: int | None  # CPU: kv_cache_memory; CUDA: None, to be measured
    gpu_memory_utilization: float  # what the CUDA measurement may fill
    kv_events: KVEventsConfig | None = None

    @property
    def needs_kv_measurement(self) -> bool:
        return self.num_kv_blocks is None and self.kv_cache_bytes is None

    def sized(self, measured_kv_bytes: int | None = None) -> EngineConfig:
        """Finish with the KV bytes a measurement found (only when ``needs_kv_measurement``)."""
        if self.num_kv_blocks is not None:
            num_blocks = self.num_kv_blocks
        else:
            available = self.kv_cache_bytes if measured_kv_bytes is None else measured_kv_bytes
            if available is None:
                raise ConfigError(
                    f"the KV pool on {self.runner.device} is sized by a profiling forward: "
                    f"pass its result (ModelRunner.profile_kv_cache_bytes) or set num_kv_blocks"
                )
            num_blocks = max(available, 0) // self.block_bytes
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=num_blocks,
            block_bytes=self.block_bytes,
            watermark=self.watermark,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_kv_cache_events=self.kv_events is not None and self.kv_events.enabled,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
        )
        return EngineConfig(
            self.model, self.runner, self.scheduler, cache, self.observability, self.kv_events
        )
