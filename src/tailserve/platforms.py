"""The host facts that ``auto`` settings resolve against, and the resolution itself.

``Platform`` is a plain value, measured once with torch by ``model.device.detect_platform``,
so that resolving configuration (``config/``, imported by the torch-free scheduler) needs no
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


_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(
    dtype: str, device: DeviceType, platform: Platform, checkpoint_dtype: str | None = None
) -> ServingDtype:
    """The dtype the weights are stored in (``dtype``).

    ``auto``: on CUDA bfloat16 where supported, else float16. On CPU with the compiled kernels,
    the checkpoint's own dtype when it is 16-bit (they read bf16 / fp16 weights as stored and
    compute in float32, see ``compute_dtype``), else float32: the kernels are the fast path
    (SmolLM2-135M on a 2-core AVX512-BF16 host, single stream: 11.0 ms/token in float32 with
    the kernels, 25.3 ms in bfloat16 through torch's own ops; benchmarks/notes/weights.md). Without
    the kernels, bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX), else float32
    (bf16 matmuls are emulated on AVX2-only CPUs and slower than float32)."""
    if dtype in _DTYPES:
        return typing.cast(ServingDtype, dtype)
    if dtype != "auto":
        raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if device == "cuda":
        return "bfloat16" if platform.cuda_bf16 else "float16"
    if platform.cpu_kernels:
        return "bfloat16" if checkpoint_dtype == "bfloat16" else (
            "float16" if checkpoint_dtype == "float16" else "float32")
    return "float32" if not platform.cpu_bf16_native else "bfloat16"


def compute_dtype(weight_dtype: ServingDtype, device: DeviceType, platform: Platform
                  ) -> ServingDtype:
    """The dtype activations are computed in: float32 on CPU with the compiled kernels (they
    widen 16-bit weights in registers), else the weights' own dtype (torch's ops)."""
    return "float32" if device == "cpu" and platform.cpu_kernels else weight_dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute: ServingDtype) -> ServingDtype:
    """``auto``: the activations' dtype; bfloat16 / float16 halve what attention reads (the
    CPU kernels widen them in registers, writes round to nearest even)."""
    if kv_cache_dtype == "auto":
        return compute
    if kv_cache_dtype not in _DTYPES:
        raise ConfigError("kv_cache_dtype must be auto, float32, bfloat16 or float16, got "
                          f"{kv_cache_dtype!r}")
    return typing.cast(ServingDtype, kv_cache_dtype)
