"""Tiny random Llama-family models saved as Hugging Face folders, for loader and parity tests.

Each builder writes a complete model folder -- config.json, *sharded* safetensors with
model.safetensors.index.json, and the bundled SmolLM2 tokenizer (tokenizer.json +
tokenizer_config.json with its chat template) -- and returns the folder's path. Weights are
random but seeded, and every parameter is randomized, including the biases and norm weights
that transformers initializes to constants, so a parity test notices a dropped bias or norm.

    path = build_tiny_llama(tmp_path / "llama")              # 2 layers, GQA 4:2, untied
    path = build_tiny_llama(tmp_path / "l3", rope_scaling={"rope_type": "llama3", ...})
    path = build_tiny_qwen2(tmp_path / "qwen2")              # q/k/v biases, untied
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tailserve.model.loader import default_model_path
from tailserve.model.tokenizer import load_gguf_tokenizer

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
# Small enough that the 12.6 MB embedding and lm_head each land in a shard of their own and
# the layers in a third: the loader's index-following path always runs.
MAX_SHARD_SIZE = "4MB"


def build_tiny_llama(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``LlamaForCausalLM``; ``overrides`` go to ``LlamaConfig`` (e.g. rope_scaling,
    tie_word_embeddings, attention_bias, num_key_value_heads, seed=...)."""
    seed = overrides.pop("seed", 0)
    config = LlamaConfig(**{**_base_config(), **TINY_SHAPE, **overrides})
    return _build(path, LlamaForCausalLM, config, seed)


def build_tiny_qwen2(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``Qwen2ForCausalLM`` (biases on q/k/v, untied lm_head unless overridden)."""
    seed = overrides.pop("seed", 0)
    config = Qwen2Config(**{**_base_config(), **TINY_SHAPE, **overrides})
    return _build(path, Qwen2ForCausalLM, config, seed)


def _base_config() -> dict[str, Any]:
    tokenizer = load_gguf_tokenizer(default_model_path())
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "rope_theta": 10000.0,
    }


def _build(
    path: str | os.PathLike[str],
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    seed: int,
) -> str:
    folder = os.fspath(path)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    load_gguf_tokenizer(default_model_path()).save_pretrained(folder)
    return folder
