"""Gemma 3 text models (270M, 1B, and the text stack of 4B-27B): interleaved local and global
layers (five sliding-window layers, then one global, unless config.json's ``layer_types`` says
otherwise), each kind with its own rope base (local 10,000; global ``rope_theta``, 1,000,000,
with rope scaling on the global layers only); QK-norm; four RMSNorms per layer, the attention's
and the MLP's outputs normed before their residual adds; GeGLU with tanh GELU; embeddings scaled
by sqrt(hidden_size); RMSNorm weights meaning 1 + w; tied embeddings; head_dim 256, not
hidden / heads; the attention scale from ``query_pre_attn_scalar``.

llama.cpp's GGUF (general.architecture ``gemma3``) stores the norms as 1 + w and q/k in
Hugging Face's row order, and names the pre-MLP norm ``ffn_norm``.
"""

from tailserve.families.base import Family

FAMILY = Family(
    "Gemma3ForCausalLM",
    gguf_architecture="gemma3",
    qk_norm=True,
    sandwich_norms=True,
    norm_weight_offset=1.0,
    scale_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    sliding_window_pattern=6,
    local_rope_theta=10000.0,
    tie_word_embeddings=True,
    gguf_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
)
