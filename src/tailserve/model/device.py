"""The host's facts that ``auto`` settings resolve against, measured with torch (and the CPU
kernels' build) once; ``config.resolve_device`` / ``resolve_dtype`` apply them torch-free."""

from __future__ import annotations

import torch

from tailserve.kernels import cpu_ops_available
from tailserve.platforms import Platform, ServingDtype


def detect_platform() -> Platform:
    cuda = torch.cuda.is_available()
    return Platform(
        cuda_available=cuda,
        cuda_bf16=cuda and torch.cuda.is_bf16_supported(),
        cpu_bf16_native=torch.cpu._is_avx512_bf16_supported()
        or torch.cpu._is_amx_tile_supported(),
        cpu_kernels=cpu_ops_available(),
    )


def torch_dtype(dtype: ServingDtype) -> torch.dtype:
    dt = getattr(torch, dtype)
    assert isinstance(dt, torch.dtype)
    return dt
