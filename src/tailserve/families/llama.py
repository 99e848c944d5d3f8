"""Llama 2 / 3 (and SmolLM2): the decoder as written, nothing more."""

from tailserve.families.base import Family

FAMILY = Family("LlamaForCausalLM", gguf_architecture="llama", gguf_qk_permuted=True)
