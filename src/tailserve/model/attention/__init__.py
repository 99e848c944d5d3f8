"""Attention backends behind one interface; ``get_attention_backend`` picks one per device."""

from __future__ import annotations

from tailserve.model.attention.base import AttentionBackend, AttentionMetadata
from tailserve.model.attention.cpu_kernels import CpuKernelAttentionBackend
from tailserve.model.attention.torch_ref import TorchAttentionBackend
from tailserve.model.triton_kernels import triton_available


def get_attention_backend(device: str, cpu_kernels: bool = False) -> AttentionBackend:
    """CPU with the compiled kernels built: the paged decode kernel; CUDA with Triton
    installed (the ``gpu`` extra): the Triton kernels; else the torch reference."""
    if device == "cpu" and cpu_kernels:
        return CpuKernelAttentionBackend()
    if device == "cuda" and triton_available():
        # Imported here: defining the kernels needs triton, and only CUDA runs them.
        from tailserve.model.attention.triton import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
