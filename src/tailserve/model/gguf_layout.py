"""How llama.cpp lays each family out in a GGUF file: its tensor names, mapped to Hugging Face
names per family; the tensor table a file must hold, checked against its metadata from the
header alone, before a byte of weights is read or a tensor allocated; the q/k row order of
``llama``; and the metadata whose meaning differs from config.json's (sliding window, rope
scaling).

A family's ``gguf_names`` (families/) override the llama names where its layers differ: Gemma 3's
``ffn_norm`` is the pre-MLP norm of four; Phi-3 stores q, k and v as one ``attn_qkv`` and gate
and up as one ``ffn_up`` (llama.cpp keeps both fused, in Hugging Face's row order), which map to
the fused Hugging Face names and are split by the family's ``fused`` declaration as they are read
(``weight_storage.fused_splitter``, the same split a Hugging Face folder gets).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from tailserve.config import ModelConfig
from tailserve.errors import ModelLoadError
from tailserve.families import Family
from tailserve.model.weight_storage import stored_weight_shapes

# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_SHOWN = 4  # names listed in one error line


def hf_name(gguf_name: str, family: Family) -> str | None:
    """The Hugging Face name ``gguf_name`` is stored under (a fused one for Phi-3's qkv and
    gate-up); None for a tensor this family's decoder does not have."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    hf_part = family.gguf_names.get(part, LAYER_NAMES.get(part))
    return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{kind}"


def unfused_names(hf: str, family: Family) -> list[str]:
    """The canonical names a stored name holds: its fused parts (``Family.fused``), or itself."""
    match = _HF_LAYER_TENSOR.fullmatch(hf)
    parts = family.fused.get(match.group(2), ()) if match is not None else ()
    if match is None or not parts:
        return [hf]
    layer, _, kind = match.groups()
    return [f"model.layers.{layer}.{part}.{kind}" for part in parts]


def gguf_name(hf: str, family: Family) -> str:
    """The llama.cpp name of the Hugging Face (stored) name ``hf``: what an error names."""
    for name, mapped in GLOBAL_NAMES.items():
        if mapped == hf:
            return name
    match = _HF_LAYER_TENSOR.fullmatch(hf)
    if match is None:
        return hf
    layer, part, kind = match.groups()
    table = {**LAYER_NAMES, **family.gguf_names}  # the family's names win
    by_hf = {v: k for k, v in table.items()}
    return f"blk.{layer}.{by_hf.get(part, part)}.{kind}"


def check_tensor_table(path: str, shapes: Mapping[str, tuple[int, ...]], config: ModelConfig,
                       family: Family) -> dict[str, str]:
    """GGUF name -> Hugging Face (stored) name of every tensor in ``shapes`` (the file's table,
    torch order), after checking that none is unknown, none the metadata implies is missing
    and each has the shape the metadata implies; ``ModelLoadError`` (one line naming the file,
    the tensor and the expectation) otherwise."""
    names: dict[str, str] = {}
    unknown: list[str] = []
    for name in shapes:
        mapped = hf_name(name, family)
        if mapped is None:
            unknown.append(name)
        else:
            names[name] = mapped
    if unknown:
        raise ModelLoadError(
            f"{path} holds {len(unknown)} tensors a {family.gguf_architecture} model does not "
            f"have: {', '.join(sorted(unknown)[:8])}"
        )
    expected = stored_weight_shapes(config)
    present = set(names.values())
    missing = [(gguf_name(hf, family), shape) for hf, shape in expected.items()
               if hf not in present]
    if missing:
        shown = ", ".join(f"{name} {list(shape)}" for name, shape in missing[:_SHOWN])
        raise ModelLoadError(
            f"{path} lacks {len(missing)} tensors its metadata implies "
            f"({_describe(config)}): {shown}"
        )
    for name, hf in names.items():
        want = expected.get(hf)
        if want is None:  # e.g. q/k/v biases in a file whose metadata implies none
            raise ModelLoadError(
                f"{path}: tensor {name} is not part of a {family.gguf_architecture} model with "
                f"{_describe(config)}"
            )
        if tuple(shapes[name]) != want:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {list(shapes[name])}, but the metadata "
                f"({_describe(config)}) implies {list(want)}"
            )
    return names


def sliding_window(path: str, metadata: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The config.json fields of a GGUF's sliding window: the window (0, as llama.cpp writes
    for Phi-4 under ``phi3``, means none) and, where the file says, which layers use it: one
    bool per layer (``layer_types``) or every n-th layer global (``sliding_window_pattern``).
    Where it says neither, the family's pattern applies (Gemma 3: every 6th layer global), else
    every layer slides (Mistral's meaning). A pattern of another form is refused by name."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is None or window == 0:
        return {}
    out: dict[str, Any] = {"sliding_window": window}
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = metadata.get(key)
    layers = metadata.get(f"{arch}.block_count")
    if pattern is None:
        return out
    if isinstance(pattern, list) and len(pattern) == layers and all(
            isinstance(p, bool) for p in pattern):
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        out["sliding_window_pattern"] = pattern
    else:
        raise ModelLoadError(
            f"{path} has {key} = {pattern!r}; expected one bool per layer ({layers}) or a "
            "positive layer count"
        )
    return out


def rope_scaling(md: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """The config.json ``rope_scaling`` a GGUF's rope metadata describes (None: none)."""
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind is None and f"{arch}.rope.scale_linear" in md:  # the pre-2024 spelling
        kind, factor = "linear", md[f"{arch}.rope.scale_linear"]
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling  # ModelConfig.from_hf rejects the kinds it cannot run (yarn, ...)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary re-ordering of the rows of a Q or K weight (or bias).

    ``convert_hf_to_gguf.py`` turns Hugging Face's "rotate half" layout into GGML's interleaved
    pairs with ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``; swapping the
    same two axes of the ``(n_head, rows // n_head // 2, 2)`` view restores the original rows.
    """
    rows, rest = w.shape[0], w.shape[1:]
    if rows % (2 * n_head):
        raise ModelLoadError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _describe(config: ModelConfig) -> str:
    return (f"hidden {config.hidden_size}, {config.num_attention_heads} heads, "
            f"{config.num_key_value_heads} KV heads of {config.head_dim}, intermediate "
            f"{config.intermediate_size}, vocab {config.vocab_size}, "
            f"{config.num_hidden_layers} layers")


__all__ = ["GLOBAL_NAMES", "LAYER_NAMES", "check_tensor_table", "gguf_name", "hf_name",
           "rope_scaling", "sliding_window", "unfused_names", "unpermute_rows"]
