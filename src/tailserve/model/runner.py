"""ModelRunner: one forward per step over a flattened mix of prefill chunks and decodes.

It owns everything on the device: the weights, the KV pool (allocated once, here, at start-up),
the rope table and the per-request sampling generators. Input: a ``SchedulerOutput``
(flattened into the forward's inputs by ``step_batch.py``); output: a ``RunnerOutput`` of
sampled token ids. Nothing here decides who runs.
"""

from __future__ import annotations

import logging
import math

import torch

from tailserve.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig, shard_config
from tailserve.data.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from tailserve.errors import ConfigError
from tailserve.kernels import cpu_ops_available
from tailserve.model.attention import get_attention_backend
from tailserve.model.cpu_decode import CpuDecodeGraph
from tailserve.model.cuda_graphs import CudaDecodeGraphs, graph_batch_sizes, wants_cuda_graphs
from tailserve.model.device import torch_dtype
from tailserve.model.llama import LlamaForCausalLM
from tailserve.model.memory_profile import MemoryProfile, profile_memory
from tailserve.model.meta_build import default_dtype, materialize_model, skip_init
from tailserve.model.parallel import TensorParallelGroup
from tailserve.model.resident_weights import resident_weight_bytes
from tailserve.model.sampler import Sampler, SamplingRow
from tailserve.model.sampling_buffers import SamplingBuffers, sampling_buffer_bytes
from tailserve.model.step_batch import StepBatch, prepare_batch
from tailserve.model.step_buffers import StepInputBuffers, step_buffer_bytes
from tailserve.model.transforms import apply_cpu_kernels
from tailserve.model.transforms.gguf_linear import apply_gguf_weights, has_packed
from tailserve.model.transforms.linear16 import cast_for_storage
from tailserve.model.transforms.tensor_parallel import apply_tensor_parallel, shard_weights
from tailserve.model.transforms.triton_kernels import apply_triton_kernels
from tailserve.model.triton_kernels import triton_available
from tailserve.obs import profiling

log = logging.getLogger(__name__)


class ModelRunner:
    """Built in two steps: the model (``__init__``), then the KV pool (``allocate_kv_cache``),
    whose size on CUDA is what a profiling forward of that model leaves
    (``profile_kv_cache_bytes``)."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: RunnerConfig,
        max_model_len: int,
        weights: dict[str, torch.Tensor],
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.tp = tp
        if tp is not None:  # this rank's slices, before any other transform wraps them
            weights = shard_weights(weights, model_config, tp.rank, tp.world_size)
            model_config = shard_config(model_config, tp.world_size)
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.compute_dtype)  # activations
        self.weight_dtype = torch_dtype(config.dtype)
        self.kv_cache_dtype = torch_dtype(config.kv_cache_dtype)
        # Compiled CPU kernels (built once per machine); the torch paths remain without them.
        self.cpu_kernels = self.device.type == "cpu" and cpu_ops_available()
        self.backend = backend = get_attention_backend(self.device.type, self.cpu_kernels)
        packed = has_packed(weights)
        if packed and not (self.cpu_kernels and self.dtype == self.weight_dtype == torch.float32):
            raise ConfigError(
                "the weights are packed GGUF blocks, which only the compiled CPU kernels read "
                f"(float32 on CPU); this runner is {config.dtype} on {config.device}"
                + ("" if self.cpu_kernels else " without the kernels")
                + ": load with gguf_weights='dequantize'"
            )
        # Built without memory, then given uninitialized tensors that load_weights fills: no
        # random initialization of weights about to be overwritten (skip_init: on meta it
        # would import torch._dynamo and Triton, 154 MB), and the float32 matrices
        # a packed-GGUF swap replaces are never allocated (538 MB for the bundled model).
        # Built in the weights' dtype and cast by role before the checkpoint is copied in, so
        # a 16-bit checkpoint is never widened into a float32 model on the way; the rope
        # table (materialize_model) stays float32.
        with torch.device("meta"), default_dtype(self.weight_dtype), skip_init():
            model = LlamaForCausalLM(model_config, backend, max_position=max_model_len)
        cast_for_storage(model, self.weight_dtype, self.dtype)
        apply_gguf_weights(model, weights)  # packed matrices (GGUF, --quantization): blocks
        materialize_model(model, self.device, max_model_len)
        model.load_weights(weights)
        if tp is not None:  # o_proj / down_proj sum their partial products over the ranks
            apply_tensor_parallel(model, tp.all_reduce)
        self.model = model.eval()
        if self.device.type == "cpu":
            apply_cpu_kernels(self.model, compiled=self.cpu_kernels)
        elif self.device.type == "cuda" and triton_available():
            apply_triton_kernels(self.model)
        # Bytes per storage format the model's tensors hold after every transform (the
        # kernels' layout copies included, a 16-bit cast counted at 16 bits): the start-up
        # log and tailserve:model_weight_bytes.
        self.weight_bytes = resident_weight_bytes(self.model)
        log.info("resident weights: %.1f MB (%s)", sum(self.weight_bytes.values()) / 1e6,
                 ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(self.weight_bytes.items())))
        # Steps in one compiled call (decodes and prefill chunks) where the CPU kernels cover
        # the whole model.
        self.decode_graph = (
            None if config.enforce_eager or self.device.type != "cpu"
            else CpuDecodeGraph.build(self.model)
        )
        self.scale = 1.0 / math.sqrt(model_config.head_dim)
        self.cache_config: CacheConfig | None = None
        self.kv_cache = torch.empty(0)
        self.kv_caches: list[torch.Tensor] = []
        self._default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(model_config.vocab_size, self._default_generator)
        self._generators: dict[str, torch.Generator] = {}
        # CUDA only, from prepare_steps: persistent step inputs and the decode graphs.
        self.step_buffers: StepInputBuffers | None = None
        self.cuda_graphs: CudaDecodeGraphs | None = None
        self.memory_profile: MemoryProfile | None = None  # CUDA: the start-up budget

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        """The whole KV cache, once: [layers, 2, num_blocks, block_size, H_kv, D]."""
        cfg = self.model_config
        self.cache_config = cache
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers, 2, cache.num_kv_blocks, cache.block_size,
            cfg.num_key_value_heads, cfg.head_dim, dtype=self.kv_cache_dtype, device=self.device,
        )
        self.kv_caches = list(self.kv_cache.unbind(0))

    def prepare_steps(self, scheduler: SchedulerConfig) -> None:
        """After the KV pool: on CUDA, the persistent step buffers sized by the scheduler's
        bounds, and the decode CUDA graphs (not with ``enforce_eager``, and only over a
        backend that can be captured). Nothing on CPU (its counterpart is CpuDecodeGraph)."""
        if self.device.type != "cuda":
            return
        cache = self.cache
        self.sampler.buffers = SamplingBuffers(scheduler.max_num_seqs, self.device,
                                               self._penalty_capacity(scheduler.max_num_seqs))
        self.step_buffers = StepInputBuffers(
            scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
            -(-self.max_model_len // cache.block_size), cache.num_kv_blocks * cache.block_size,
            self.device,
        )
        if not wants_cuda_graphs(self.device.type, self.config.enforce_eager, self.backend):
            return
        if self.tp is not None:
            log.info("CUDA graphs off under tensor parallelism: decode steps run eagerly")
            return
        graphs = CudaDecodeGraphs(graph_batch_sizes(scheduler.max_num_seqs))
        try:
            with torch.inference_mode():
                graphs.capture(self.model, self.step_buffers, self.kv_caches, self.backend,
                               cache.block_size, self.scale, self.max_model_len)
        except Exception as exc:  # refuse with the reason, serve eagerly (DESIGN rule 6)
            log.warning("CUDA graphs off, decode steps run eagerly: capture failed with "
                        "%s: %s", type(exc).__name__, exc)
            torch.cuda.synchronize(self.device)
            return
        self.cuda_graphs = graphs

    def _penalty_capacity(self, max_num_seqs: int) -> int:
        """The bound on the penalties' distinct (row, token) keys in a step."""
        return max_num_seqs * min(self.model_config.vocab_size, self.max_model_len)

    @property
    def cuda_graph_bytes(self) -> int:
        return self.cuda_graphs.pool_bytes if self.cuda_graphs is not None else 0

    @property
    def cache(self) -> CacheConfig:
        if self.cache_config is None:
            raise RuntimeError("the KV cache is not allocated yet (allocate_kv_cache)")
        return self.cache_config

    @property
    def num_kv_blocks(self) -> int:
        return self.cache.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def profile_kv_cache_bytes(
        self, num_tokens: int, block_size: int, utilization: float, max_num_seqs: int = 1
    ) -> int:
        """CUDA: run one forward of ``num_tokens`` (the token budget) and return the bytes
        left for the KV pool under ``utilization`` of the device's memory
        (``memory_profile.py``; the figures stay in ``self.memory_profile``)."""
        cfg = self.model_config
        graphs = wants_cuda_graphs(self.device.type, self.config.enforce_eager, self.backend)
        self.memory_profile = profile_memory(
            self.model, self.backend, self.device, self.kv_cache_dtype, cfg.num_key_value_heads,
            cfg.head_dim, cfg.num_hidden_layers, num_tokens, max_num_seqs, block_size,
            self.scale, utilization, cuda_graphs=graphs,
            buffers_bytes=step_buffer_bytes(num_tokens, max_num_seqs,
                                            -(-self.max_model_len // block_size))
            + sampling_buffer_bytes(max_num_seqs, self._penalty_capacity(max_num_seqs)),
        )
        if self.tp is not None:  # every rank's pool has the same blocks: the smallest fits
            return self.tp.min_over_ranks(self.memory_profile.kv_cache_bytes)
        return self.memory_profile.kv_cache_bytes

    # ------------------------------------------------------------------ one step
    def _prepare(self, sched: SchedulerOutput) -> StepBatch:
        """The step's inputs (``step_batch.py``); a method so the step profilers
        (benchmarks/step_profile.py, pyspy_summary.py) find the phase by its name."""
        return prepare_batch(
            sched, self.block_size, self.scale, self.device, self.step_buffers,
            self.cuda_graphs.sizes if self.cuda_graphs is not None else None,
        )

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        """The step's hidden states: a CUDA graph, the CPU one-call graph (decodes and
        prefill chunks alike), or the modules."""
        if self.decode_graph is not None and self.decode_graph.supports(batch.meta):
            # The one call attends by itself: the backend's per-step plan (begin_step) is
            # for the attention modules only, so it is not made here.
            return self.decode_graph(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        self.backend.begin_step(batch.meta)
        if batch.graph_batch_size is not None and self.cuda_graphs is not None:
            return self.cuda_graphs.replay(batch.graph_batch_size, batch.meta.num_seqs)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    @staticmethod
    def _sampled_rows(hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """[num_sampling, hidden]: the rows the LM head reads. ``index_select``, not
        ``hidden[index]``: advanced indexing enters an OpenMP region from 8 rows on (waking
        OpenMP's sleeping threads against the kernels' pool), index_select up to ~64."""
        if batch.logits_indices is None and hidden.is_contiguous():
            return hidden
        index = batch.logits_indices
        if index is None:
            index = torch.arange(len(batch.sampling), device=hidden.device)
        return hidden.index_select(0, index)

    def _generator_for(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(s.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[s.request_id] = gen
        return gen

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for rid in sched.finished_request_ids:
            self._generators.pop(rid, None)
        if not sched.scheduled:
            return RunnerOutput(sampled_token_ids={})
        if self.tp is not None:  # the workers run the same forward on their shards
            self.tp.send_step(sched.scheduled)
        with profiling.span("prepare_inputs"):
            batch = self._prepare(sched)
        with profiling.span("forward"):
            hidden = self._forward(batch)
            if batch.sampling:
                logits = self.model.compute_logits(self._sampled_rows(hidden, batch))
            if self.step_buffers is not None:
                # The last reads of the buffers are enqueued: the next step's copy may start.
                self.step_buffers.mark_consumed()
            if not batch.sampling:
                return RunnerOutput(sampled_token_ids={})
        rows = [
            SamplingRow(
                params=s.sampling_params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids,
                eos_token_ids=s.eos_token_ids,
                generator=self._generator_for(s),
                token_bitmask=sched.token_bitmasks.get(s.request_id),
            )
            for s in batch.sampling
        ]
        with profiling.span("sample"):
            result = self.sampler(logits, rows)
        sampled = {s.request_id: t for s, t in zip(batch.sampling, result.token_ids, strict=True)}
        logprobs = {
            s.request_id: lp
            for s, lp in zip(batch.sampling, result.logprobs, strict=True)
            if lp is not None
        }
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @torch.inference_mode()
    def execute_worker(self, sched: SchedulerOutput) -> None:
        """A tensor-parallel worker's step (rank > 0): the forward on this rank's shards,
        flattened as rank 0 flattened it; rank 0 alone computes logits and samples."""
        batch = self._prepare(sched)
        self._forward(batch)
        if self.step_buffers is not None:
            self.step_buffers.mark_consumed()
