"""Phi-3 / Phi-3.5 (mini, medium): q, k and v stored as one projection, gate and up as one;
otherwise a Llama decoder. Its long-context variants' ``longrope`` scaling is refused by name
(config.SUPPORTED_ROPE_TYPES; in a GGUF, its ``rope_factors_long`` / ``_short`` tensors). The
4k variants' ``sliding_window`` (2,047) is served, on every layer, as transformers serves it.

llama.cpp's GGUF (general.architecture ``phi3``) keeps both fused, in Hugging Face's row order
(no q/k permutation: its rope for phi3 is the "rotate half" form), as ``attn_qkv`` and
``ffn_up``; the loader splits them as it splits a Hugging Face folder's. Its converter writes
``phi3.attention.sliding_window`` always, 0 for none (Phi-4); llama.cpp itself disables Phi's
window, so past 2,047 tokens its answers and tailserve's (the checkpoint's) differ.
"""

from tailserve.families.base import Family

FAMILY = Family(
    "Phi3ForCausalLM",
    gguf_architecture="phi3",
    fused={
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    },
    gguf_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)
