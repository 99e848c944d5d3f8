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
    # RMSNorm after attention and after the MLP too, each output normed before its residual
    # add (Gemma's four norms per layer: input, post_attention, pre_ and post_feedforward).
    sandwich_norms: bool = False
    # Added to every RMSNorm weight of a Hugging Face checkpoint as it is read: Gemma's norms
    # compute x * (1 + w). llama.cpp's converter stores 1 + w already, so a GGUF's take none.
    norm_weight_offset: float = 0.0
    # Token embeddings multiplied by sqrt(hidden_size) (Gemma; not the tied LM head).
    scale_embeddings: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation (model_features.SERVED_ACTIVATIONS)
    # Every n-th layer global, the others within the sliding window (Gemma 3: 6).
    sliding_window_pattern: int | None = None
    # The sliding layers' rope base (Gemma 3: 10,000, the global layers' 1,000,000); None: one.
    local_rope_theta: float | None = None
    tie_word_embeddings: bool = False
    # GGUF layer tensor names (after ``blk.N.``) that map elsewhere in this family than in
    # llama's (Gemma 3's ffn_norm is the pre-MLP norm of four, not the second of two).
    gguf_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp's converter permuted the q and k rows for its interleaved rope (only "llama").
    gguf_qk_permuted: bool = False
