"""The resolved configuration of one engine (``EngineConfig`` and its parts: runner, cache,
scheduler, KV events, observability), frozen, built once by ``EngineArgs.resolve``; each
component takes only its own part."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from tailserve.config.model import ModelConfig
from tailserve.errors import ConfigError, json_object
from tailserve.kv_groups import KVGroupLayout, blocks_per_seq, max_blocks_per_seq
from tailserve.platforms import (
    DeviceType,
    ServingDtype,
)
from tailserve.request import RequestLimits

# How full KV blocks are keyed for prefix caching (kv.block_pool.HashAlgo, which this layer
# cannot import: the same two values).
PrefixHashAlgo = Literal["sha256", "xxh64"]


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
    # One block, K and V, in RunnerConfig.kv_cache_dtype: every layer, or with KV cache
    # groups ``kv_groups.layers_per_block`` of them.
    block_bytes: int
    watermark: float = 0.05
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False  # the block pool records what it caches and evicts
    prefix_caching_hash_algo: PrefixHashAlgo = "sha256"
    # A sliding-window model's KV cache groups (kv_groups.py): its local layers release the
    # blocks their window passed. None: one table per request over every layer.
    kv_groups: KVGroupLayout | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.block_bytes

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return (None,) if self.kv_groups is None else self.kv_groups.group_windows

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block where some group releases."""
        return self.num_kv_blocks - (1 if self.kv_groups is not None
                                     and self.kv_groups.releases else 0)


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


def check_pool_fits(scheduler: SchedulerConfig, cache: CacheConfig) -> None:
    """One max_model_len sequence must fit the pool, or a long request could wait forever
    (with KV cache groups: its blocks in every group, chunks of the step's token budget)."""
    blocks_per_seq = max_blocks_per_seq(cache.group_windows, scheduler.max_model_len,
                                        cache.block_size, scheduler.max_num_batched_tokens)
    if blocks_per_seq > cache.num_usable_blocks:
        raise ConfigError(
            f"one max_model_len={scheduler.max_model_len} sequence needs {blocks_per_seq} KV "
            f"blocks of {cache.block_size} tokens but the pool has {cache.num_usable_blocks}; "
            f"raise kv_cache_memory / num_kv_blocks or lower max_model_len"
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
        value = json_object(value, "kv_events_config", {f.name for f in fields(cls)})
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
            block_size=self.cache.block_size, num_kv_blocks=self.cache.num_usable_blocks,
            max_request_tokens=max_request_tokens(self.scheduler, self.cache),
            kv_group_windows=self.cache.group_windows,
        )


def kv_capacity(config: EngineConfig) -> str | None:
    """The start-up log's line on what KV cache groups save (None without them): a
    ``max_model_len`` sequence's blocks against every layer global, and how many fit."""
    cache, groups = config.cache, config.cache.kv_groups
    if groups is None:
        return None
    max_len, bs = config.scheduler.max_model_len, cache.block_size
    held = blocks_per_seq(cache.group_windows, max_len, bs) * cache.block_bytes
    all_global = -(-max_len // bs) * bs * (
        cache.block_bytes // bs // groups.layers_per_block * config.model.num_hidden_layers)
    fit = cache.num_usable_blocks // blocks_per_seq(cache.group_windows, max_len, bs)
    windows = ["global" if w is None else w for w in cache.group_windows]
    return (f"KV cache groups {windows} (blocks of {groups.layers_per_block} layers): a "
            f"{max_len}-token sequence holds {held / (1 << 20):.1f} MiB of KV, "
            f"{held / all_global:.0%} of the {all_global / (1 << 20):.1f} MiB every layer "
            f"global would; {fit} such sequences fit the pool")


def max_request_tokens(scheduler: SchedulerConfig, cache: CacheConfig) -> int:
    """The per-request token cap: the user's, else every token the pool holds (where local
    layers release blocks: at least as many max_model_len sequences as fit the pool)."""
    if scheduler.max_request_tokens is not None:
        return scheduler.max_request_tokens
    tokens = cache.num_kv_blocks * cache.block_size
    if cache.kv_groups is None:
        return tokens
    per_seq = blocks_per_seq(cache.group_windows, scheduler.max_model_len, cache.block_size)
    return max(tokens, cache.num_usable_blocks // per_seq * scheduler.max_model_len)


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
    kv_groups: KVGroupLayout | None = None  # CacheConfig.kv_groups

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
            kv_groups=self.kv_groups,
        )
        return EngineConfig(
            self.model, self.runner, self.scheduler, cache, self.observability, self.kv_events
        )
