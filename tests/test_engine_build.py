"""Start-up exists once (engine/build.py): the offline LLM, the engine process and every
tensor-parallel worker take the same ``EngineBuilder`` steps, in the same order."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from tailserve import LLM
from tailserve.config import EngineArgs
from tailserve.engine.build import EngineBuilder
from tailserve.errors import ModelLoadError
from tailserve.platforms import Platform

ENGINE = {"dtype": "float32", "num_kv_blocks": 96, "max_num_seqs": 4,
          "max_num_batched_tokens": 32}
# CPU: the pool is sized from kv_cache_memory / num_kv_blocks, no profiling forward to measure.
CPU_STEPS = ["load", "resolve", "build_runner", "size", "allocate"]


def test_the_offline_llm_takes_the_builder_steps(tiny_model_dir: str) -> None:
    llm = LLM(tiny_model_dir, **ENGINE)
    assert llm.engine.startup_steps == CPU_STEPS
    # The transforms' reports reach the engine (the Ready message's ``transforms``).
    assert list(llm.engine.transforms)[:4] == ["storage_cast", "gguf_weights", "materialize",
                                               "load"]


def test_rank_0_and_a_worker_take_the_same_steps(
        tiny_model_dir: str, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    # The worker logs at rank 0's level: DEBUG shows each of its steps on its stderr, which
    # it shares with this process.
    caplog.set_level(logging.DEBUG)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        rank0 = llm.engine.startup_steps
    finally:
        llm.engine.close()
    assert not torch.distributed.is_initialized()
    worker = re.findall(r"rank 1 start-up step (\w+):", capfd.readouterr().err)
    assert rank0 == worker == CPU_STEPS


def test_gguf_weights_and_quantization_resolve_in_config() -> None:
    kernels = Platform(cuda_available=False, cpu_kernels=True)
    bare = Platform(cuda_available=False)
    assert EngineArgs().resolve_load(kernels).gguf_weights == "packed"
    assert EngineArgs().resolve_load(bare).gguf_weights == "dequantize"
    # A split of packed blocks must fall on block boundaries: auto dequantizes under TP.
    assert EngineArgs(tensor_parallel_size=2).resolve_load(kernels).gguf_weights == "dequantize"
    assert EngineArgs(tensor_parallel_size=2, gguf_weights="packed").resolve_load(
        kernels).gguf_weights == "packed"
    with pytest.raises(ModelLoadError, match="float32 on cpu without the kernels"):
        EngineArgs(gguf_weights="packed").resolve_load(bare)
    with pytest.raises(ModelLoadError, match=r"--quantization int8 needs the compiled CPU "
                       r"kernels .* this engine runs float32 on cpu without the kernels"):
        EngineArgs(quantization="int8").resolve_load(bare)
    assert EngineArgs(quantization="int4").resolve_load(kernels).quantization == "int4"


def test_a_builder_records_no_step_it_did_not_take(tiny_model_dir: str) -> None:
    builder = EngineBuilder(EngineArgs(model=tiny_model_dir, **ENGINE))  # type: ignore[arg-type]
    loaded = builder.load()
    builder.resolve(loaded)
    assert builder.steps == ["load", "resolve"]
