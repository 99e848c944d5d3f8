"""EngineArgs.resolve: one frozen EngineConfig, the values the engine runs with, and the same
config on both sides of the engine process's socket (Ready)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tailserve.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from tailserve.engine.messages import Ready, message_decoder, message_encoder
from tailserve.errors import ConfigError
from tailserve.model.device import detect_platform
from tailserve.platforms import Platform, resolve_device, resolve_dtype

# 2 layers x 2 KV heads x head_dim 16: one 16-token block is 2*2*16*2*16 = 2048 elements.
MODEL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
    tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0},
    bos_token_id=1, eos_token_ids=(2, 3),
)

# A CPU-only host with the compiled kernels: what resolution sees on this project's machines.
HOST = Platform(cuda_available=False, cpu_kernels=True)


def cpu(**kw: object) -> EngineConfig:
    return EngineArgs(device="cpu", dtype="float32", **kw).resolve(MODEL, HOST)  # type: ignore[arg-type]


def test_defaults_on_cpu() -> None:
    c = cpu()
    assert c.model is MODEL
    assert c.runner == RunnerConfig(device="cpu", dtype="float32", seed=0, enforce_eager=False)
    assert c.scheduler == SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048,
        enable_chunked_prefill=True, long_prefill_token_threshold=None,
        admission_policy="optimistic", scheduling_policy="deadline", max_queue_len=None,
        slo_ttft_s=1.0, slo_itl_s=0.1, slo_tpot_s=None, enable_slo_admission=False,
    )
    # 2 GiB of float32 blocks of 8192 bytes.
    assert c.cache == CacheConfig(block_size=16, num_kv_blocks=262144, block_bytes=8192,
                                  watermark=0.05, enable_prefix_caching=True)
    assert c.cache.kv_cache_bytes == 2 << 30
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cache.num_kv_blocks = 1  # type: ignore[misc]


def test_token_budget_defaults() -> None:
    assert cpu().scheduler.max_num_batched_tokens == 512
    # It holds every running decode ...
    assert cpu(max_num_seqs=600).scheduler.max_num_batched_tokens == 600
    # ... and whole prompts when prefills are not chunked.
    assert cpu(enable_chunked_prefill=False).scheduler.max_num_batched_tokens == 2048
    assert cpu(enable_chunked_prefill=False, max_model_len=300).scheduler \
        .max_num_batched_tokens == 512
    assert cpu(max_num_batched_tokens=100).scheduler.max_num_batched_tokens == 100


def test_max_model_len_default_and_limit() -> None:
    assert cpu().scheduler.max_model_len == 2048
    assert cpu(max_model_len=1000).scheduler.max_model_len == 1000
    with pytest.raises(ConfigError, match=r"max_model_len \(4096\) exceeds the model's context "
                       r"length \(2048\)"):
        cpu(max_model_len=4096)


def test_num_kv_blocks_from_memory_dtype_and_override() -> None:
    assert cpu(kv_cache_memory=0.05).cache.num_kv_blocks == int(0.05 * (1 << 30)) // 8192
    # The pool follows kv_cache_dtype (auto: the activations', float32 on the CPU kernels
    # whatever the weights are stored in).
    bf16w = EngineArgs(device="cpu", dtype="bfloat16", kv_cache_memory=0.05).resolve(MODEL, HOST)
    assert bf16w.cache.block_bytes == 8192
    bf16 = EngineArgs(device="cpu", kv_cache_dtype="bfloat16", kv_cache_memory=0.05).resolve(
        MODEL, HOST)
    assert bf16.cache.block_bytes == 4096
    assert bf16.cache.num_kv_blocks == int(0.05 * (1 << 30)) // 4096
    assert cpu(block_size=32).cache.block_bytes == 16384
    # The override wins over any memory figure.
    assert cpu(num_kv_blocks=300, kv_cache_memory=0.001).cache.num_kv_blocks == 300


def test_a_pool_too_small_for_one_sequence_fails_at_resolve() -> None:
    with pytest.raises(ConfigError, match="max_model_len=2048 sequence needs 128 KV blocks of 16 "
                       "tokens but the pool has 100"):
        cpu(num_kv_blocks=100)
    assert cpu(num_kv_blocks=100, max_model_len=1600).cache.num_kv_blocks == 100


def test_cuda_pool_is_sized_by_the_measurement() -> None:
    cpu_unsized = EngineArgs(device="cpu", dtype="float16", kv_cache_dtype="float16"
                             ).resolve_unsized(MODEL, HOST)
    assert not cpu_unsized.needs_kv_measurement
    cuda = RunnerConfig(device="cuda", dtype="float16", compute_dtype="float16",
                        kv_cache_dtype="float16")
    unsized = dataclasses.replace(cpu_unsized, runner=cuda, kv_cache_bytes=None)
    assert unsized.needs_kv_measurement
    with pytest.raises(ConfigError, match="profiling forward"):
        unsized.sized()
    sized = unsized.sized(1 << 20)  # 1 MiB left / 4096-byte blocks
    assert sized.cache.num_kv_blocks == 256 and sized.runner.device == "cuda"
    assert not dataclasses.replace(unsized, num_kv_blocks=200).needs_kv_measurement
    assert dataclasses.replace(unsized, num_kv_blocks=200).sized().cache.num_kv_blocks == 200


def test_ready_round_trips_the_engine_config() -> None:
    config = cpu(max_queue_len=7, admission_policy="reserve", enforce_eager=True)
    ready = Ready(config=config, model="/models/x.gguf", pid=123)
    back = message_decoder.decode(message_encoder.encode(ready))
    assert isinstance(back, Ready) and back == ready
    assert isinstance(back.config, EngineConfig)
    assert isinstance(back.config.cache, CacheConfig)
    assert back.config.model.eos_token_ids == (2, 3)
    assert back.config.model.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert back.config.scheduler.max_queue_len == 7


def test_the_engine_runs_with_its_resolved_config(tiny_model_dir: str) -> None:
    from tailserve.engine.core import EngineCore
    from tailserve.engine.loop import EngineLoop

    args = EngineArgs(model=tiny_model_dir, device="cpu", dtype="float32",
                      kv_cache_memory=0.01, max_num_seqs=4)
    core = EngineCore.from_args(args)
    assert core.config == args.resolve(core.loaded.config, detect_platform())
    cache = core.config.cache
    assert core.snapshot().kv.num_blocks == cache.num_kv_blocks
    assert core.runner.kv_cache.shape[2] == cache.num_kv_blocks
    assert core.runner.kv_cache_bytes == cache.kv_cache_bytes
    assert core.scheduler.config is core.config.scheduler
    ready = EngineLoop(core, lambda msg: None).ready_message()
    assert message_decoder.decode(message_encoder.encode(ready)) == ready


def test_config_module_does_not_import_torch() -> None:
    code = ("import sys, tailserve.config as c; c.EngineArgs(); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(("platform", "device", "dtype"), [
    # the CPU kernels compute in float32 and are the fast path, bf16-native CPU or not
    (Platform(cuda_available=False, cpu_bf16_native=True, cpu_kernels=True), "cpu", "float32"),
    (Platform(cuda_available=False, cpu_kernels=True), "cpu", "float32"),
    # without them: bfloat16 only where the CPU computes it natively
    (Platform(cuda_available=False, cpu_bf16_native=True), "cpu", "bfloat16"),
    (Platform(cuda_available=False), "cpu", "float32"),
    (Platform(cuda_available=True, cuda_bf16=True), "cuda", "bfloat16"),
    (Platform(cuda_available=True), "cuda", "float16"),
])
def test_auto_resolves_against_the_platform(platform: Platform, device: str, dtype: str) -> None:
    assert resolve_device("auto", platform) == device
    assert resolve_dtype("auto", resolve_device("auto", platform), platform) == dtype
    # An explicit choice is kept whatever the host.
    assert resolve_dtype("bfloat16", "cpu", platform) == "bfloat16"


def test_device_and_dtype_mistakes_name_the_value() -> None:
    with pytest.raises(ConfigError, match="device='cuda' was asked for but torch sees no CUDA"):
        resolve_device("cuda", HOST)
    with pytest.raises(ConfigError, match="device must be auto, cpu or cuda, got 'tpu'"):
        resolve_device("tpu", HOST)
    with pytest.raises(ConfigError, match="dtype must be auto, float32, bfloat16 or float16, "
                                          "got 'int3'"):
        resolve_dtype("int3", "cpu", HOST)
