"""Tiny random Llama-family models saved as Hugging Face folders, for loader and parity tests.

Each builder writes a complete model folder -- config.json, *sharded* safetensors with
model.safetensors.index.json, and the bundled SmolLM2 tokenizer (tokenizer.json +
tokenizer_config.json with its chat template) -- and returns the folder's path. Weights are
random but seeded, and every parameter is randomized, including the biases and norm weights
that transformers initializes to constants, so a parity test notices a dropped bias or norm.

    path = build_tiny_llama(tmp_path / "llama")              # 2 layers, GQA 4:2, untied
    path = build_tiny_llama(tmp_path / "l3", rope_scaling={"rope_type": "llama3", ...})
    path = build_tiny_qwen2(tmp_path / "qwen2")              # q/k/v biases, untied
    path = build_tiny_mistral(tmp_path / "m", sliding_window=8)  # every layer slides
    path = build_tiny_gemma3(tmp_path / "g")  # local and global layers, four norms each
    path = build_tiny_llama(tmp_path / "b", dtype=torch.bfloat16)  # stored in bfloat16
    path = save_default_model_as_hf(tmp_path / "smol", torch.bfloat16)  # the bundled GGUF's
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
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
    tie_word_embeddings, attention_bias, num_key_value_heads, seed=..., dtype=...)."""
    seed = overrides.pop("seed", 0)
    dtype = overrides.pop("dtype", torch.float32)
    config = LlamaConfig(**{**_base_config(), **TINY_SHAPE, **overrides})
    return _build(path, LlamaForCausalLM, config, seed, dtype)


def build_tiny_qwen2(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``Qwen2ForCausalLM`` (biases on q/k/v, untied lm_head unless overridden)."""
    seed = overrides.pop("seed", 0)
    config = Qwen2Config(**{**_base_config(), **TINY_SHAPE, **overrides})
    return _build(path, Qwen2ForCausalLM, config, seed)


def build_tiny_mistral(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``MistralForCausalLM`` (``sliding_window`` None unless overridden)."""
    seed = overrides.pop("seed", 0)
    overrides.setdefault("sliding_window", None)
    config = MistralConfig(**{**_base_config(), **TINY_SHAPE, **overrides})
    return _build(path, MistralForCausalLM, config, seed)


def build_tiny_qwen3(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``Qwen3ForCausalLM``: QK-norm, head_dim 32 given explicitly (not 64 / 4)."""
    seed = overrides.pop("seed", 0)
    overrides.setdefault("head_dim", 32)
    config = Qwen3Config(**{**_base_config(), **TINY_SHAPE, **overrides})
    return _build(path, Qwen3ForCausalLM, config, seed)


def build_tiny_phi3(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``Phi3ForCausalLM``: q/k/v stored as one qkv_proj, gate/up as one gate_up_proj."""
    seed = overrides.pop("seed", 0)
    base = _base_config()
    config = Phi3Config(**{**base, "pad_token_id": base["eos_token_id"], **TINY_SHAPE,
                           **overrides})
    return _build(path, Phi3ForCausalLM, config, seed)


def build_tiny_gemma3(path: str | os.PathLike[str], **overrides: Any) -> str:
    """A random ``Gemma3ForCausalLM`` (transformers' ``Gemma3TextConfig``): two sliding layers
    (window 8, rope base 10,000) then a global one (rope base 1,000,000 with linear scaling),
    QK-norm, four norms per layer, tanh-GELU, head_dim 32 (not 64 / 4), an attention scale from
    ``query_pre_attn_scalar`` 24 (not head_dim), final-logit soft-capping, tied embeddings."""
    seed = overrides.pop("seed", 0)
    shape = {**TINY_SHAPE, "num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": True}
    config = Gemma3TextConfig(**{
        **_base_config(), **shape, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0,
        **overrides,
    })
    return _build(path, Gemma3ForCausalLM, config, seed)


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
    dtype: torch.dtype = torch.float32,
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
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    load_gguf_tokenizer(default_model_path()).save_pretrained(folder)
    return folder


def save_default_model_as_hf(path: str | os.PathLike[str], dtype: torch.dtype,
                             loaded: Any = None) -> str:
    """The bundled SmolLM2 GGUF as a Hugging Face folder in ``dtype`` (its weights as the
    loader dequantizes them, rounded to nearest even): the default model as a bf16 / fp16
    checkpoint, for parity tests and the 16-bit weight benchmarks. ``loaded``: the float32
    ``load_model(None)`` where the caller has it already."""
    from safetensors.torch import save_file

    from tailserve.model.loader import load_model

    if loaded is None:
        loaded = load_model(None)
    cfg = loaded.config
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in loaded.weights.items()},
              os.path.join(folder, "model.safetensors"))
    config = {
        "architectures": [cfg.architecture], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": str(dtype).removeprefix("torch."),
    }
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1)
    loaded.tokenizer.save_pretrained(folder)
    return folder
