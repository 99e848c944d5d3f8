"""Qwen3 (dense): QK-norm, an RMSNorm over each head of q and of k before rope; no q/k/v
biases; ``head_dim`` given explicitly (128, not hidden / heads).

llama.cpp's GGUF (general.architecture ``qwen3``) stores q and k in Hugging Face's row order
(its rope for qwen3 is the "rotate half" form: no permutation, as for qwen2), the norms as
``attn_q_norm`` / ``attn_k_norm`` and head_dim as ``qwen3.attention.key_length``.
"""

from tailserve.families.base import Family

FAMILY = Family("Qwen3ForCausalLM", gguf_architecture="qwen3", qk_norm=True)
