"""ModelRunner: one forward per step over a flattened mix of prefill chunks and decodes.

It owns everything on the device: the model (``model/build.py`` builds it), the KV pool
(allocated once at start-up, by ``engine/build.py``'s builder; on CUDA sized and prepared by
``runner_setup.py``), the rope table and the per-request sampling generators. Input: a
``SchedulerOutput`` (flattened into the forward's inputs by ``step_batch.py``); output: a
``RunnerOutput`` of sampled token ids. Nothing here decides who runs.
"""

from __future__ import annotations

import torch

from tailserve.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from tailserve.data.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from tailserve.model.build import build_model
from tailserve.model.cuda_graphs import CudaDecodeGraphs
from tailserve.model.device import torch_dtype
from tailserve.model.memory_profile import MemoryProfile
from tailserve.model.parallel import TensorParallelGroup
from tailserve.model.runner_setup import prepare_cuda_steps, profile_kv_cache
from tailserve.model.sampler import Sampler, SamplingRow
from tailserve.model.step_batch import StepBatch, prepare_batch
from tailserve.model.step_buffers import StepInputBuffers
from tailserve.obs import profiling


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
        # The model and what was built around it (model/build.py): this rank's shape, the
        # attention backend, the CPU one-call step graph, the transforms' reports.
        self.built = built = build_model(model_config, config, max_model_len, weights, tp)
        self.model_config = built.model_config
        self.model = built.model
        self.backend = built.backend
        self.decode_graph = built.decode_graph
        self.weight_bytes = built.weight_bytes
        self.cpu_kernels = built.cpu_kernels
        self.max_model_len = max_model_len
        self.config = config
        self.device = torch.device(config.device)
        self.kv_cache_dtype = torch_dtype(config.kv_cache_dtype)
        self.scale = built.scale
        self.cache_config: CacheConfig | None = None
        self.kv_cache = torch.empty(0)
        self.kv_caches: list[torch.Tensor] = []
        self._default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.model_config.vocab_size, self._default_generator)
        self._generators: dict[str, torch.Generator] = {}
        # CUDA only, from prepare_steps: persistent step inputs and the decode graphs.
        self.step_buffers: StepInputBuffers | None = None
        self.cuda_graphs: CudaDecodeGraphs | None = None
        self.memory_profile: MemoryProfile | None = None  # CUDA: the start-up budget

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        """The whole KV cache, once: [layers, 2, num_blocks, block_size, H_kv, D]; with KV
        cache groups (kv_groups.py) [layers_per_block, ...], layer i in slot
        ``layer_slot[i]`` (its group's block ids index it). Zeros, so the null block a
        released table slot points at is finite: the window masks give it weight 0, and a
        NaN there would still poison the weighted sum."""
        cfg = self.model_config
        self.cache_config = cache
        groups = cache.kv_groups
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers if groups is None else groups.layers_per_block,
            2, cache.num_kv_blocks, cache.block_size,
            cfg.num_key_value_heads, cfg.head_dim, dtype=self.kv_cache_dtype, device=self.device,
        )
        slots = list(self.kv_cache.unbind(0))
        self.kv_caches = slots if groups is None else [slots[i] for i in groups.layer_slot]

    def prepare_steps(self, scheduler: SchedulerConfig) -> None:
        """After the KV pool: on CUDA the step buffers and decode graphs
        (``runner_setup.prepare_cuda_steps``); nothing on CPU (its counterpart is
        CpuDecodeGraph)."""
        if self.device.type == "cuda":
            prepare_cuda_steps(self, scheduler)

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
        """CUDA: the bytes a profiling forward of ``num_tokens`` leaves for the KV pool
        (``runner_setup.profile_kv_cache``)."""
        return profile_kv_cache(self, num_tokens, block_size, utilization, max_num_seqs)

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
        if batch.group_metas is not None:
            # Layers of several KV cache groups read several tables: the modules do.
            self.backend.begin_step(batch.meta)
            groups = self.cache.kv_groups
            assert groups is not None
            metas = [batch.group_metas[g] for g in groups.layer_group]
            return self.model(batch.input_ids, batch.positions, self.kv_caches, metas)
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
