"""Building the served model: a plain PyTorch model, then one ordered list of transforms.

``build_model`` is the one place a runner's model is made. It builds ``LlamaForCausalLM`` on
the meta device (no memory, no random initialization: ``meta_build.py``) and hands it through
``model_transforms``, in this order, which is the invariant (each step needs what the steps
before it made, and must run before the ones after it read what it changed):

1. ``storage_cast``: parameters in their storage dtype (matmul weights and embeddings in the
   weights' dtype, norms and biases in the compute dtype) *before* a byte of the checkpoint is
   copied in, so a 16-bit checkpoint is never widened into a float32 model on the way.
2. ``gguf_weights``: linears whose checkpoint matrices are packed GGUF blocks swapped for
   their block forms while still on meta: their float32 matrices are never allocated.
3. ``materialize``: every parameter still on meta becomes a real, uninitialized tensor on the
   device; the rope table is computed there (float32).
4. ``load``: the checkpoint copied in (the modules of step 2 hold theirs already).
5. ``tensor_parallel``: o_proj / down_proj sum their partial products over the ranks; after the
   load (the wrapped linears hold this rank's slice) and before the kernels, which swap the
   wrapped linear inside the wrapper.
6. ``cpu_kernels`` (CPU): the norms, rope, SwiGLU and projections swapped for the compiled
   kernels' forms and layout copies: last, they copy the loaded weights.
7. ``triton_kernels`` (CUDA with Triton): the norms, rope and SwiGLU as Triton kernels.

Each transform says whether it applies to a configuration and platform, and reports what it
did (``TransformReport``); the reports are logged at start-up, carried by the engine's
``Ready`` message and shown in ``/metrics``. After the list: the resident weight bytes and,
on CPU unless ``enforce_eager``, the one-call step graph (``CpuDecodeGraph``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from tailserve.config import ModelConfig, RunnerConfig, shard_config
from tailserve.errors import ConfigError
from tailserve.model.attention import AttentionBackend, get_attention_backend
from tailserve.model.cpu_decode import CpuDecodeGraph
from tailserve.model.device import detect_platform, torch_dtype
from tailserve.model.llama import LlamaForCausalLM
from tailserve.model.meta_build import default_dtype, materialize_model, skip_init
from tailserve.model.parallel import TensorParallelGroup
from tailserve.model.resident_weights import resident_weight_bytes
from tailserve.model.transforms import apply_cpu_kernels
from tailserve.model.transforms.gguf_linear import apply_gguf_weights, has_packed
from tailserve.model.transforms.linear16 import cast_for_storage
from tailserve.model.transforms.report import TransformReport
from tailserve.model.transforms.tensor_parallel import apply_tensor_parallel, shard_weights
from tailserve.model.transforms.triton_kernels import apply_triton_kernels
from tailserve.model.triton_kernels import triton_available
from tailserve.platforms import Platform

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class BuildConfig:
    """What one rank's model is built from: its shape (sharded under tensor parallelism), how
    it runs, the longest sequence (the rope table) and the rank's group, if any."""

    model: ModelConfig
    runner: RunnerConfig
    max_model_len: int
    tp: TensorParallelGroup | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.runner.device)

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch_dtype(self.runner.dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch_dtype(self.runner.compute_dtype)


class ModelTransform(Protocol):
    """One step of ``model_transforms``: ``applies`` decides from the configuration and the
    host, ``apply`` changes the model in place (and may replace ``weights`` entries it
    consumed) and reports what it did."""

    @property
    def name(self) -> str:
        """The key of its report (``BuiltModel.reports``) and its label in /metrics."""

    def applies(self, config: BuildConfig, platform: Platform) -> bool: ...

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport: ...


@dataclass(frozen=True)
class StorageCast:
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    name: ClassVar[str] = "storage_cast"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return True

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        cast_for_storage(model, self.weight_dtype, self.compute_dtype)
        return TransformReport()


@dataclass(frozen=True)
class GGUFWeights:
    name: ClassVar[str] = "gguf_weights"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return True  # a no-op (empty report) without packed weights

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        return apply_gguf_weights(model, weights)


@dataclass(frozen=True)
class Materialize:
    device: torch.device
    max_model_len: int
    name: ClassVar[str] = "materialize"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return True

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        materialize_model(model, self.device, self.max_model_len)
        return TransformReport()


@dataclass(frozen=True)
class LoadWeights:
    name: ClassVar[str] = "load"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return True

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        model.load_weights(weights)
        return TransformReport()


@dataclass(frozen=True)
class TensorParallel:
    tp: TensorParallelGroup | None
    name: ClassVar[str] = "tensor_parallel"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return self.tp is not None

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        assert self.tp is not None
        return apply_tensor_parallel(model, self.tp.all_reduce)


@dataclass(frozen=True)
class CpuKernels:
    compiled: bool  # the torch.ops.tailserve ops are built (Platform.cpu_kernels)
    name: ClassVar[str] = "cpu_kernels"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return config.device.type == "cpu"

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        return apply_cpu_kernels(model, compiled=self.compiled)


@dataclass(frozen=True)
class TritonKernels:
    name: ClassVar[str] = "triton_kernels"

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return config.device.type == "cuda" and triton_available()

    def apply(self, model: LlamaForCausalLM, weights: Weights) -> TransformReport:
        return apply_triton_kernels(model)


def model_transforms(config: BuildConfig, platform: Platform) -> list[ModelTransform]:
    """The transforms in the order they run (the module docstring says why this order)."""
    return [
        StorageCast(config.weight_dtype, config.compute_dtype),
        GGUFWeights(),
        Materialize(config.device, config.max_model_len),
        LoadWeights(),
        TensorParallel(config.tp),
        CpuKernels(compiled=platform.cpu_kernels),
        TritonKernels(),
    ]


@dataclass
class BuiltModel:
    """What ``build_model`` made: the model in eval mode, the attention backend it was built
    with, the one-call CPU step graph (None: eager, not CPU, or refused with a logged reason),
    resident weight bytes per storage format, and each applied transform's report, in order."""

    model: LlamaForCausalLM
    model_config: ModelConfig  # this rank's shape
    backend: AttentionBackend
    decode_graph: CpuDecodeGraph | None
    weight_bytes: dict[str, int]
    cpu_kernels: bool  # CPU with the compiled kernels
    reports: dict[str, TransformReport] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.model_config.attention_scale

    def describe(self) -> str:
        """One line for the start-up log: each applied transform and what it swapped."""
        parts = []
        for name, report in self.reports.items():
            swapped = ", ".join(f"{k} x{v}" for k, v in sorted(report.swapped.items()))
            extra = f" {report.bytes_added / 1e6:+.1f} MB" if report.bytes_added else ""
            parts.append(f"{name}" + (f" ({swapped}{extra})" if swapped or extra else ""))
        return "; ".join(parts)


def build_model(
    model_config: ModelConfig, runner: RunnerConfig, max_model_len: int, weights: Weights,
    tp: TensorParallelGroup | None = None, *, platform: Platform | None = None,
    extra_transforms: Sequence[ModelTransform] = (),
) -> BuiltModel:
    """The model a runner serves, from the checkpoint's ``weights`` (whole; sliced here for
    ``tp``'s rank). ``extra_transforms`` run after the list (tests: an injected fault).
    As ``apply_gguf_weights`` does, entries of ``weights`` it consumed are replaced by views
    of the model's tensors (the checkpoint's own copies can then go)."""
    platform = detect_platform() if platform is None else platform
    if tp is not None:  # this rank's slices, before any transform wraps them
        weights = shard_weights(weights, model_config, tp.rank, tp.world_size)
        model_config = shard_config(model_config, tp.world_size)
    config = BuildConfig(model_config, runner, max_model_len, tp)
    device = config.device
    cpu_kernels = device.type == "cpu" and platform.cpu_kernels
    if has_packed(weights) and not (
        cpu_kernels and config.compute_dtype == config.weight_dtype == torch.float32
    ):
        raise ConfigError(
            "the weights are packed GGUF blocks, which only the compiled CPU kernels read "
            f"(float32 on CPU); this runner is {runner.dtype} on {runner.device}"
            + ("" if cpu_kernels else " without the kernels")
            + ": load with gguf_weights='dequantize'"
        )
    backend = get_attention_backend(device.type, cpu_kernels)
    with torch.device("meta"), default_dtype(config.weight_dtype), skip_init():
        model = LlamaForCausalLM(model_config, backend, max_position=max_model_len)
    reports: dict[str, TransformReport] = {}
    for transform in [*model_transforms(config, platform), *extra_transforms]:
        if transform.applies(config, platform):
            reports[transform.name] = transform.apply(model, weights)
    model.eval()
    # Bytes per storage format the model's tensors hold after every transform (the kernels'
    # layout copies included, a 16-bit cast counted at 16 bits): the start-up log and
    # tailserve:model_weight_bytes.
    weight_bytes = resident_weight_bytes(model)
    log.info("resident weights: %.1f MB (%s)", sum(weight_bytes.values()) / 1e6,
             ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(weight_bytes.items())))
    # Steps in one compiled call (decodes and prefill chunks) where the CPU kernels cover the
    # whole model.
    decode_graph = (None if runner.enforce_eager or device.type != "cpu"
                    else CpuDecodeGraph.build(model))
    built = BuiltModel(model, model_config, backend, decode_graph, weight_bytes, cpu_kernels,
                       reports)
    log.info("model transforms: %s", built.describe())
    return built
