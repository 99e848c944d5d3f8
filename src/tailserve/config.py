"""Configuration: ``ModelConfig`` (what the weights are) and ``EngineArgs`` (how to serve them).

``EngineArgs`` is the one dataclass behind the offline ``LLM(**engine_args)`` and the CLI: every
field becomes a ``--flag`` of the same name (``max_num_seqs`` ⇄ ``--max-num-seqs``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from tailserve.errors import ConfigError, ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
        rope_scaling = cfg.get("rope_scaling") or None
        # transformers >= 4.45 nests rope settings under rope_parameters in some exports.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass
class EngineArgs:
    """Everything that configures an engine. Field names are the CLI flag names."""

    model: str | None = field(
        default=None, metadata={"help": "HF folder or .gguf file; default: bundled SmolLM2-135M"}
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto", metadata={"help": "auto: bfloat16 where the device does it well"}
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output; default: the model's context"}
    )
    max_num_seqs: int = field(default=64, metadata={"help": "requests running at once"})
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "token budget per step; default 512 on CPU, 4096 on GPU"}
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
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = field(
        default=None, metadata={"help": "most prompt tokens one request may take in one step"}
    )
    admission_policy: Literal["optimistic", "reserve"] = "optimistic"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    seed: int = 0
    max_queue_len: int | None = field(
        default=None, metadata={"help": "waiting requests beyond which new ones are rejected"}
    )
    tensor_parallel_size: int = 1
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "run every step through the PyTorch module forward; by default CPU "
                  "decode-only steps run all layers in one compiled call (the CPU analogue of "
                  "a CUDA graph)"},
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
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet (only 1)"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 1, "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ConfigError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if not 0.0 < self.memory_alert <= 1.0:
            raise ConfigError(f"memory_alert must be in (0, 1], got {self.memory_alert}")
        if self.steady_memory_tolerance < 0 or self.steady_memory_warmup < 0:
            raise ConfigError(
                "steady_memory_tolerance and steady_memory_warmup must be >= 0, got "
                f"{self.steady_memory_tolerance} and {self.steady_memory_warmup}"
            )

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SchedulerConfig:
    """The resolved, torch-free subset of EngineArgs the scheduler needs."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    watermark: float = 0.05
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    admission_policy: Literal["optimistic", "reserve"] = "optimistic"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_queue_len: int | None = None

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
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if blocks_per_seq > self.num_kv_blocks:
            raise ConfigError(
                f"one max_model_len={self.max_model_len} sequence needs {blocks_per_seq} KV blocks "
                f"of {self.block_size} tokens but the pool has {self.num_kv_blocks}; raise "
                f"kv_cache_memory / num_kv_blocks or lower max_model_len"
            )
