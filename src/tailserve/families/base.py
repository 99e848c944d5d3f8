"""``Family``: the declaration each family file fills in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """What one family's checkpoints mean, beyond the shape fields every config.json has.

    ``fused`` maps a stored weight name (relative to ``model.layers.<i>.``) to the canonical
    names it holds, stacked along the output rows in that order: Phi-3 stores q, k and v as one
    ``self_attn.qkv_proj`` and gate and up as one ``mlp.gate_up_proj``. The loader splits them
    into the canonical (Llama) names as it reads them, so quantization, the shape check and the
    decoder see one naming.
    """

    architecture: str  # config.json's architectures[0]
    gguf_architecture: str | None = None  # GGUF general.architecture, where served
    # Biases on q, k and v when config.json does not say (Qwen2's are implied).
    attention_bias: bool = False
    # RMSNorm over each head of q and of k before rope (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
