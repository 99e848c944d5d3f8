"""Qwen3 (dense): QK-norm, an RMSNorm over each head of q and of k before rope; no q/k/v
biases; ``head_dim`` given explicitly (128, not hidden / heads)."""

from tailserve.families.base import Family

FAMILY = Family("Qwen3ForCausalLM", qk_norm=True)
