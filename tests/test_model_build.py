"""``build_model``: one ordered list of transforms, each reporting what it did.

The order is the documented invariant (model/build.py's docstring lists it); the reports are
what the start-up log and ``tailserve:model_transform_*`` show, so they are asserted exactly on
the tiny model (2 layers: 4 fused projections each and an untied LM head; 2 norms each and the
final one)."""

from __future__ import annotations

import re

import pytest
import torch

from tailserve.config import EngineArgs
from tailserve.model import build as build_module
from tailserve.model.build import BuildConfig, BuiltModel, build_model, model_transforms
from tailserve.model.device import detect_platform
from tailserve.model.llama import LlamaForCausalLM
from tailserve.model.loader import load_model
from tailserve.model.transforms import TransformReport
from tailserve.platforms import Platform

ORDER = ["storage_cast", "gguf_weights", "materialize", "load", "tensor_parallel",
         "cpu_kernels", "triton_kernels"]


def _build(path: str, platform: Platform | None = None, **kwargs: object) -> BuiltModel:
    loaded = load_model(path)
    platform = detect_platform() if platform is None else platform
    cfg = EngineArgs(model=path, kv_cache_memory=0.02, max_model_len=256).resolve(
        loaded.config, platform)
    return build_model(cfg.model, cfg.runner, 256, loaded.weights, platform=platform,
                       **kwargs)  # type: ignore[arg-type]


def test_the_transforms_run_in_the_documented_order(tiny_model_dir: str) -> None:
    loaded = load_model(tiny_model_dir)
    platform = Platform(cuda_available=False)
    cfg = EngineArgs(model=tiny_model_dir).resolve(loaded.config, platform)
    names = [t.name for t in model_transforms(
        BuildConfig(cfg.model, cfg.runner, 256), platform)]
    assert names == ORDER
    # The docstring's numbered list names them in the same order.
    doc = build_module.__doc__ or ""
    assert re.findall(r"^\d\. ``(\w+)``", doc, re.MULTILINE) == ORDER


@pytest.mark.usefixtures("cpu_kernels")
def test_a_cpu_build_reports_every_applied_transform(tiny_model_dir: str) -> None:
    built = _build(tiny_model_dir)
    assert list(built.reports) == ["storage_cast", "gguf_weights", "materialize", "load",
                                   "cpu_kernels"]  # no group, no CUDA
    assert built.reports["cpu_kernels"].swapped == {
        "Linear": 9, "RMSNorm": 5, "ApplyRope": 2, "SiluAndMul": 2}
    assert built.reports["load"] == TransformReport()
    assert built.cpu_kernels and built.decode_graph is not None
    assert built.describe().startswith("storage_cast; gguf_weights; materialize; load; "
                                       "cpu_kernels (ApplyRope x2, Linear x9, RMSNorm x5, "
                                       "SiluAndMul x2 +")


@pytest.mark.usefixtures("cpu_kernels")
def test_packed_gguf_reports_its_swapped_matrices() -> None:
    loaded = load_model(None, gguf_weights="packed")
    platform = detect_platform()
    cfg = EngineArgs(max_model_len=256, kv_cache_memory=0.02).resolve(loaded.config, platform)
    built = build_model(cfg.model, cfg.runner, 256, loaded.weights, platform=platform)
    # 30 layers x 4 fused projections and the LM head; the embedding table as blocks.
    assert built.reports["gguf_weights"].swapped == {"Linear": 121, "Embedding": 1}
    assert built.reports["cpu_kernels"].swapped == {"RMSNorm": 61, "ApplyRope": 30,
                                                    "SiluAndMul": 30}


class _Marker:
    """A transform a test adds: it runs after the list and sees the finished model."""

    name = "marker"

    def __init__(self) -> None:
        self.saw: list[str] = []

    def applies(self, config: BuildConfig, platform: Platform) -> bool:
        return True

    def apply(self, model: LlamaForCausalLM, weights: dict[str, torch.Tensor]
              ) -> TransformReport:
        self.saw.append(type(model.layers[0].input_layernorm).__name__)
        return TransformReport(swapped={"marked": 1})


def test_an_extra_transform_runs_last(tiny_model_dir: str) -> None:
    marker = _Marker()
    built = _build(tiny_model_dir, Platform(cuda_available=False), extra_transforms=[marker])
    assert list(built.reports)[-1] == "marker"
    assert built.reports["marker"].swapped == {"marked": 1}
    # Without the compiled kernels the CPU transform keeps the torch norm (their fused op
    # is not there to call); the marker saw the model as the list left it.
    assert marker.saw == ["RMSNorm"]
    assert not built.cpu_kernels
