"""Phi-3 / Phi-3.5 (mini, medium): q, k and v stored as one projection, gate and up as one;
otherwise a Llama decoder. Its long-context variants' ``longrope`` scaling is refused by name
(config.SUPPORTED_ROPE_TYPES)."""

from tailserve.families.base import Family

FAMILY = Family(
    "Phi3ForCausalLM",
    fused={
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    },
)
