"""Qwen2 / Qwen2.5: biases on q, k and v (implied, config.json seldom says so)."""

from tailserve.families.base import Family

FAMILY = Family("Qwen2ForCausalLM", gguf_architecture="qwen2", attention_bias=True)
