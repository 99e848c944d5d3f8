"""The host facts that ``auto`` settings resolve against, and the resolution itself.

``Platform`` is a plain value, measured once with torch by ``model.device.detect_platform``,
so that resolving configuration (``config.py``, imported by the torch-free scheduler) needs no
torch, and tests can state any host.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from tailserve.errors import ConfigError

DeviceType = Literal["cpu", "cuda"]
ServingDtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class Platform:
    """What this host offers: the facts ``auto`` is resolved against."""

    cuda_available: bool
    cuda_bf16: bool = False  # torch.cuda.is_bf16_supported()
    cpu_bf16_native: bool = False  # AVX512-BF16 or AMX
    cpu_kernels: bool = False  # tailserve's compiled CPU kernels are built and loaded


def resolve_device(device: str, platform: Platform) -> DeviceType:
    if device == "auto":
        return "cuda" if platform.cuda_available else "cpu"
    if device == "cuda" and not platform.cuda_available:
        raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {device!r}")
    return "cuda" if device == "cuda" else "cpu"


def resolve_dtype(dtype: str, device: DeviceType, platform: Platform) -> ServingDtype:
    """``auto``: on CUDA bfloat16 where supported, else float16. On CPU float32 whenever the
    compiled CPU kernels are there: they compute in float32 and are the fast path (SmolLM2-135M
    on a 2-core AVX512-BF16 host, single stream: 11.0 ms/token in float32 with the kernels,
    25.3 ms in bfloat16 through torch's own ops; benchmarks/RESULTS.md). Without the kernels,
    bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX), else float32 (bf16 matmuls
    are emulated on AVX2-only CPUs and slower than float32)."""
    if dtype in ("float32", "bfloat16", "float16"):
        return typing.cast(ServingDtype, dtype)
    if dtype != "auto":
        raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if device == "cuda":
        return "bfloat16" if platform.cuda_bf16 else "float16"
    if platform.cpu_kernels or not platform.cpu_bf16_native:
        return "float32"
    return "bfloat16"
