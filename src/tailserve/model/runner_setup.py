"""What a CUDA runner needs before its first step, made once at start-up (``engine/build.py``
calls these through the runner): the profiling forward that sizes the KV pool, then the
persistent step and sampling buffers and the decode CUDA graphs. The runner itself only runs
steps (``runner.py``); nothing here runs on CPU, whose counterpart is ``CpuDecodeGraph``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tailserve.config import SchedulerConfig
from tailserve.model.cuda_graphs import CudaDecodeGraphs, graph_batch_sizes, wants_cuda_graphs
from tailserve.model.memory_profile import profile_memory
from tailserve.model.sampling_buffers import SamplingBuffers, sampling_buffer_bytes
from tailserve.model.step_buffers import StepInputBuffers, step_buffer_bytes

if TYPE_CHECKING:
    from tailserve.model.runner import ModelRunner

log = logging.getLogger(__name__)


def penalty_capacity(runner: ModelRunner, max_num_seqs: int) -> int:
    """The bound on the penalties' distinct (row, token) keys in a step."""
    return max_num_seqs * min(runner.model_config.vocab_size, runner.max_model_len)


def profile_kv_cache(runner: ModelRunner, num_tokens: int, block_size: int, utilization: float,
                     max_num_seqs: int = 1) -> int:
    """CUDA: run one forward of ``num_tokens`` (the token budget) and return the bytes left
    for the KV pool under ``utilization`` of the device's memory (``memory_profile.py``; the
    figures stay in ``runner.memory_profile``)."""
    cfg = runner.model_config
    graphs = wants_cuda_graphs(runner.device.type, runner.config.enforce_eager, runner.backend)
    profile = profile_memory(
        runner.model, runner.backend, runner.device, runner.kv_cache_dtype,
        cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, num_tokens, max_num_seqs,
        block_size, runner.scale, utilization, cuda_graphs=graphs,
        buffers_bytes=step_buffer_bytes(num_tokens, max_num_seqs,
                                        -(-runner.max_model_len // block_size))
        + sampling_buffer_bytes(max_num_seqs, penalty_capacity(runner, max_num_seqs)),
    )
    runner.memory_profile = profile
    if runner.tp is not None:  # every rank's pool has the same blocks: the smallest fits
        return runner.tp.min_over_ranks(profile.kv_cache_bytes)
    return profile.kv_cache_bytes


def prepare_cuda_steps(runner: ModelRunner, scheduler: SchedulerConfig) -> None:
    """After the KV pool: the persistent step buffers sized by the scheduler's bounds, and the
    decode CUDA graphs (not with ``enforce_eager``, and only over a backend that can be
    captured)."""
    cache = runner.cache
    runner.sampler.buffers = SamplingBuffers(scheduler.max_num_seqs, runner.device,
                                             penalty_capacity(runner, scheduler.max_num_seqs))
    runner.step_buffers = StepInputBuffers(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
        -(-runner.max_model_len // cache.block_size), cache.num_kv_blocks * cache.block_size,
        runner.device,
    )
    if not wants_cuda_graphs(runner.device.type, runner.config.enforce_eager, runner.backend):
        return
    if runner.tp is not None:
        log.info("CUDA graphs off under tensor parallelism: decode steps run eagerly")
        return
    graphs = CudaDecodeGraphs(graph_batch_sizes(scheduler.max_num_seqs))
    try:
        with torch.inference_mode():
            graphs.capture(runner.model, runner.step_buffers, runner.kv_caches, runner.backend,
                           cache.block_size, runner.scale, runner.max_model_len)
    except Exception as exc:  # refuse with the reason, serve eagerly (DESIGN rule 6)
        log.warning("CUDA graphs off, decode steps run eagerly: capture failed with %s: %s",
                    type(exc).__name__, exc)
        torch.cuda.synchronize(runner.device)
        return
    runner.cuda_graphs = graphs
