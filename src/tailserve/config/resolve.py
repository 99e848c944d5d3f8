"""The one resolution of ``EngineArgs`` (what the user asked for) against a model and the host
into the frozen parts of an ``EngineConfig``: ``auto`` device and dtypes, the default token
budget, the loader's request and every sub-config. ``EngineArgs.resolve`` and its
``resolve_*`` siblings are the way in; nothing else builds these parts from arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailserve.config.engine import (
    KVEventsConfig,
    ObservabilityConfig,
    RunnerConfig,
    SchedulerConfig,
    UnsizedEngineConfig,
)
from tailserve.config.load import (
    LoadConfig,
    check_quantization_supported,
    resolve_gguf_weights,
)
from tailserve.config.model import (
    ModelConfig,
    check_tensor_parallel,
    kv_block_bytes,
    resolve_kv_groups,
    resolve_max_model_len,
    sliding_window_served,
)
from tailserve.platforms import (
    DeviceType,
    Platform,
    compute_dtype,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)

if TYPE_CHECKING:
    from tailserve.config.args import EngineArgs

# Default token budget per step (max_num_batched_tokens) by device type.
DEFAULT_BATCHED_TOKENS: dict[DeviceType, int] = {"cpu": 512, "cuda": 4096}


def resolve_unsized(
    args: EngineArgs, model: ModelConfig, platform: Platform
) -> UnsizedEngineConfig:
    """Everything but the KV pool's size, which on CUDA needs a profiling forward of the
    model built with this configuration (``UnsizedEngineConfig.needs_kv_measurement``)."""
    runner = resolve_runner(args, platform, model.checkpoint_dtype)
    max_model_len = resolve_max_model_len(args.max_model_len, model,
                                          sliding_window_served(runner.device))
    check_tensor_parallel(model, args.tensor_parallel_size)
    budget = args.max_num_batched_tokens
    if budget is None:
        # The default must hold every running decode, and whole prompts when not chunking.
        budget = max(DEFAULT_BATCHED_TOKENS[runner.device], args.max_num_seqs)
        if not args.enable_chunked_prefill:
            budget = max(budget, max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        admission_policy=args.admission_policy,
        scheduling_policy=args.scheduling_policy,
        max_queue_len=args.max_queue_len,
        max_request_tokens=args.max_request_tokens,
        slo_ttft_s=args.slo_ttft_ms / 1e3,
        slo_itl_s=None if args.slo_itl_ms is None else args.slo_itl_ms / 1e3,
        slo_tpot_s=None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3,
        enable_slo_admission=args.enable_slo_admission,
        prefill_scheduling=args.prefill_scheduling,
        prefill_aging_s_per_token=args.prefill_aging_s_per_1k_tokens / 1e3,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
    )
    observability = ObservabilityConfig(
        memory_alert=args.memory_alert,
        assert_steady_memory=args.assert_steady_memory,
        steady_memory_tolerance=args.steady_memory_tolerance,
        steady_memory_warmup=args.steady_memory_warmup,
    )
    kv_events = KVEventsConfig.parse(args.kv_events_config)
    # CPU: the pool is given in GiB; CUDA: whatever the profiling forward leaves.
    kv_bytes = None if runner.device == "cuda" else int(args.kv_cache_memory * (1 << 30))
    kv_groups = resolve_kv_groups(model, max_model_len, runner.device,
                                  runner.tensor_parallel_size)
    return UnsizedEngineConfig(
        model=model,
        runner=runner,
        scheduler=scheduler,
        observability=observability,
        block_size=args.block_size,
        block_bytes=kv_block_bytes(model, args.block_size, runner.kv_cache_dtype,
                                   runner.tensor_parallel_size, kv_groups),
        watermark=args.watermark,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=kv_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_events=kv_events,
        kv_groups=kv_groups,
    )


def resolve_load(args: EngineArgs, platform: Platform) -> LoadConfig:
    """What the loader is asked for, before the model is read (its checkpoint dtype
    unknown yet: a 16-bit checkpoint neither packs nor quantizes, float32 decides)."""
    runner = resolve_runner(args, platform)
    check_quantization_supported(args.quantization, runner.device, runner.dtype,
                                 platform.cpu_kernels)
    gguf = resolve_gguf_weights(args.gguf_weights, runner.device, runner.dtype,
                                platform.cpu_kernels, args.tensor_parallel_size)
    return LoadConfig(args.model, gguf, args.quantization, args.quantization_group_size)


def resolve_runner(
args: EngineArgs, platform: Platform, checkpoint_dtype: str | None = None
) -> RunnerConfig:
    """Device and dtypes resolved from ``auto`` (the loader needs the device and the weight
    dtype before the model; ``checkpoint_dtype`` is what the checkpoint stores, if known)."""
    device = resolve_device(args.device, platform)
    if args.quantization is not None:  # blocks + float32: what the packed kernels serve
        checkpoint_dtype = None
    weights = resolve_dtype(args.dtype, device, platform, checkpoint_dtype)
    compute = compute_dtype(weights, device, platform)
    return RunnerConfig(
        device=device,
        dtype=weights,
        compute_dtype=compute,
        kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, compute),
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
    )
