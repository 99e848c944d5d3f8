"""Attention backends behind one interface; ``get_attention_backend`` picks one per device."""

from __future__ import annotations

from tailserve.model.attention.base import AttentionBackend, AttentionMetadata
from tailserve.model.attention.cpu_kernels import CpuKernelAttentionBackend
from tailserve.model.attention.torch_ref import TorchAttentionBackend


def get_attention_backend(device: str, cpu_kernels: bool = False) -> AttentionBackend:
    """CPU with the compiled kernels built: the paged decode kernel; else the torch reference.

    GPU kernels plug in here by device.
    """
    if device == "cpu" and cpu_kernels:
        return CpuKernelAttentionBackend()
    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
