"""Resolve ``device`` / ``dtype`` ``auto`` against the hardware: the one place config needs torch.

``EngineArgs.resolve`` imports this lazily so that ``tailserve.config`` (and the scheduler that
imports it) stays torch-free.
"""

from __future__ import annotations

import torch

from tailserve.config import DeviceType, ServingDtype
from tailserve.errors import ConfigError


def detect_device(device: str) -> DeviceType:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {device!r}")
    return "cuda" if device == "cuda" else "cpu"


def detect_dtype(dtype: str, device: DeviceType) -> ServingDtype:
    """``auto``: bfloat16 where the hardware computes it natively, else float32 (CPU) or
    float16 (CUDA).

    On CPU that means AVX512-BF16 or AMX; on AVX2-only CPUs bf16 matmuls are emulated and
    slower than float32, so float32 wins there.
    """
    if dtype == "float32":
        return "float32"
    if dtype == "bfloat16":
        return "bfloat16"
    if dtype == "float16":
        return "float16"
    if dtype != "auto":
        raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if device == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    bf16_native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if bf16_native else "float32"


def torch_dtype(dtype: ServingDtype) -> torch.dtype:
    dt = getattr(torch, dtype)
    assert isinstance(dt, torch.dtype)
    return dt
