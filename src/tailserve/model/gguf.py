"""Read a llama.cpp GGUF file into a ``ModelConfig`` and Hugging Face-named weights.

Weights come out as float32 (every tensor dequantized: the reference path), or, with
``packed=True``, the matrices of the formats the CPU kernels read (``model/quant/formats.py``)
as their stored blocks, byte for byte, and only the rest (norms, F16 matrices) as float32.
The file's own parsing (header, metadata, tensor table) is ``model/gguf_file.py``.

GGUF stores dimensions fastest-moving first (``ne0`` = input features); shapes below are in torch
order, so a ``[ne0, ne1]`` matrix becomes ``[ne1, ne0]`` = ``[out_features, in_features]``.
"""

from __future__ import annotations

import logging
from typing import Any

import gguf
import torch

from tailserve.config import SUPPORTED_ROPE_TYPES, ModelConfig
from tailserve.errors import ModelLoadError
from tailserve.families import GGUF_FAMILIES
from tailserve.model.gguf_file import GGUFFile, read_gguf
from tailserve.model.gguf_layout import (
    check_tensor_table,
    hf_name,
    rope_scaling,
    sliding_window,
    unfused_names,
    unpermute_rows,
)
from tailserve.model.quant.formats import PACKED_FORMATS
from tailserve.model.weight_storage import fused_splitter

log = logging.getLogger(__name__)

__all__ = [
    "GGUF_ARCHITECTURES",
    "ROPE_FREQS",
    "GGUFFile",
    "gguf_model_config",
    "load_gguf_weights",
    "packed_storage",
    "read_gguf",
    "unpermute_rows",
]

# llama.cpp architecture name -> the Hugging Face class whose weights and math it stores.
# GGUF general.architecture -> config.json architecture, for the families that declare one.
GGUF_ARCHITECTURES = {name: f.architecture for name, f in GGUF_FAMILIES.items()}


# Types that are values, not blocks: float32 serves them with nothing lost.
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16)


# llama.cpp's Llama 3.1+ rope scaling, as per-dimension factors (``_rope_freqs``).
ROPE_FREQS = "rope_freqs.weight"


def gguf_model_config(f: GGUFFile) -> ModelConfig:
    """The ``ModelConfig`` a GGUF file describes, via the same validation as ``config.json``."""
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{f.path} holds GGUF architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    md = f.metadata

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in md:
            raise ModelLoadError(f"{f.path} lacks the GGUF metadata key '{arch}.{key}'")
        return md[f"{arch}.{key}"]

    if "token_embd.weight" not in f.tensors:
        raise ModelLoadError(f"{f.path} has no token_embd.weight tensor")
    freq_factors = _rope_freqs(f)
    longrope = sorted(n for n in ("rope_factors_long.weight", "rope_factors_short.weight")
                      if n in f.tensors)
    if longrope:
        # Phi-3's 128k-context variants: llama.cpp's converter writes their longrope scaling
        # as per-dimension factor tensors; tailserve's rope serves no longrope.
        raise ModelLoadError(
            f"{f.path} stores longrope scaling ({', '.join(longrope)}: a long-context Phi-3), "
            f"which is not supported; supported rope scaling: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    num_heads = int(need("attention.head_count"))
    num_kv_heads = md.get(f"{arch}.attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise ModelLoadError(
            f"{f.path} has a per-layer head_count_kv ({type(num_kv_heads).__name__}); only one "
            "value for all layers is supported"
        )
    hidden = int(need("embedding_length"))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // num_heads))
    value_dim = md.get(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelLoadError(
            f"{f.path} has value heads of {value_dim} and key heads of {head_dim} dimensions "
            f"({arch}.attention.value_length / key_length); only equal ones are supported"
        )
    rope_dims = md.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{f.path} rotates {rope_dims} of {head_dim} head dimensions (partial rotary); "
            "only full rotary embeddings are supported"
        )
    hf: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        # The embedding's row count, not the token list: it is what the weights index.
        "vocab_size": f.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(md.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "rope_scaling": _with_factors(f.path, rope_scaling(md, arch), freq_factors),
        **sliding_window(f.path, f.metadata, arch),
        "final_logit_softcapping": md.get(f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": md.get(f"{arch}.attn_logit_softcapping"),
        # llama.cpp's embedding models (non-causal attention): refused by from_hf, by name
        "use_bidirectional_attention": md.get(f"{arch}.attention.causal") is False,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        # End of text, end of turn, end of message: llama.cpp stops on all three, and so do we.
        "eos_token_id": list(
            dict.fromkeys(
                md[key]
                for key in (
                    "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.eom_token_id",
                )
                if key in md
            )
        ),
    }
    try:
        return ModelConfig.from_hf(hf)
    except ModelLoadError as exc:  # what the file asks that is not served: name the file
        raise ModelLoadError(f"{f.path}: {exc}") from None


def _rope_freqs(f: GGUFFile) -> list[float] | None:
    """The per-dimension rope factors llama.cpp's converter writes for Llama 3.1+ rope scaling
    (``rope_freqs.weight``: head_dim / 2 divisors of the inverse frequencies, no parameters;
    llama.cpp divides each rotation frequency by its factor, and so does tailserve)."""
    info = f.tensors.get(ROPE_FREQS)
    if info is None:
        return None
    factors = f.dequantize(ROPE_FREQS)
    if factors.dim() != 1 or not bool(torch.isfinite(factors).all()) or \
            bool((factors <= 0).any()):
        raise ModelLoadError(
            f"{f.path}: {ROPE_FREQS} must be one positive, finite factor per pair of rotated "
            f"dimensions; it has shape {list(info.shape)}"
            + ("" if factors.dim() != 1 else f" and values {factors.min().item():g} to "
               f"{factors.max().item():g}"))
    return [float(x) for x in factors]


def _with_factors(path: str, scaling: dict[str, Any] | None, factors: list[float] | None
                  ) -> dict[str, Any] | None:
    if factors is None:
        return scaling
    if scaling is not None:
        raise ModelLoadError(
            f"{path} has both a {ROPE_FREQS} tensor and rope scaling metadata "
            f"({scaling.get('rope_type')}): one rope, two scalings; not served")
    return {"rope_type": "freq_factors", "freq_factors": factors}


def _kept_packed(info: Any) -> bool:
    """Whether the packed loader keeps a tensor as its blocks (else: float32)."""
    return len(info.shape) == 2 and info.ggml_type in PACKED_FORMATS


def packed_storage(f: GGUFFile) -> dict[str, str]:
    """HF name -> block format of every tensor ``load_gguf_weights(packed=True)`` keeps as its
    blocks (the others become float32): what ``tailserve plan`` counts, from the header."""
    family = GGUF_FAMILIES[f.architecture]
    out = {}
    for name, info in f.tensors.items():
        stored = hf_name(name, family)
        if stored is not None and _kept_packed(info):
            # a fused tensor's parts are its rows: kept as blocks alike
            for part in unfused_names(stored, family):
                out[part] = PACKED_FORMATS[info.ggml_type].name
    return out


def load_gguf_weights(
    f: GGUFFile, config: ModelConfig, *, packed: bool = False
) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name, Q/K un-permuted: dequantized to float32, or
    with ``packed`` the matrices in a format of ``PACKED_FORMATS`` as their blocks (a
    matrix of another quantized type is dequantized, with a warning naming it)."""
    family = GGUF_FAMILIES[f.architecture]  # gguf_model_config checked it
    # From the header, before seconds of dequantizing and before a tensor is allocated.
    # rope_freqs is the rope's configuration (ModelConfig.rope_scaling), not a weight.
    names = check_tensor_table(f.path, {n: i.shape for n, i in f.tensors.items()
                                        if n != ROPE_FREQS}, config,
                               family)
    split = fused_splitter(config)
    weights: dict[str, torch.Tensor] = {}
    fallback: list[str] = []
    permuted = family.gguf_qk_permuted
    for name, stored in names.items():
        info = f.tensors[name]
        try:
            if packed and _kept_packed(info):
                tensor = f.packed(name)
            else:
                if packed and len(info.shape) == 2 and info.ggml_type not in _FLOAT_TYPES:
                    fallback.append(f"{name} ({info.ggml_type.name})")
                tensor = f.dequantize(name)
        except NotImplementedError as exc:  # a type gguf's numpy code has no dequantizer for
            raise ModelLoadError(f"{f.path}: cannot dequantize {name}: {exc}") from exc
        # Only llama.cpp's "llama" converter permutes; the others store HF order.
        if permuted and ".self_attn.q_proj." in stored:
            tensor = unpermute_rows(tensor, config.num_attention_heads).contiguous()
        elif permuted and ".self_attn.k_proj." in stored:
            tensor = unpermute_rows(tensor, config.num_key_value_heads).contiguous()
        for part_name, part in ([(stored, tensor)] if split is None else split(stored, tensor)):
            weights[part_name] = part.contiguous()
    if fallback:
        log.warning(
            "%s: %d matrices are in ggml types the packed kernels do not read (supported: %s); "
            "dequantized to float32 instead: %s", f.path, len(fallback),
            ", ".join(fmt.name for fmt in PACKED_FORMATS.values()), ", ".join(fallback[:8]),
        )
    return weights
