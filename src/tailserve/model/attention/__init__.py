"""Attention backends behind one interface; ``get_attention_backend`` picks one per device."""

from __future__ import annotations

from tailserve.model.attention.base import AttentionBackend, AttentionMetadata
from tailserve.model.attention.torch_ref import TorchAttentionBackend


def get_attention_backend(device: str) -> AttentionBackend:
    """The torch reference backend runs everywhere; GPU kernels plug in here by device."""
    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
