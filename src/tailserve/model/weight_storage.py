"""What each weight of a model is stored as, and how many bytes that takes: one count for the
runner (its start-up log and ``tailserve:model_weight_bytes``) and for ``tailserve plan``.

A weight's storage is a format name: a float dtype (``float32``, ``bfloat16``, ``float16``) or a
ggml block format (``Q4_1``, ``Q8_0``, ...: ``[rows, cols / block] x type_size`` bytes, block and
type size from ``gguf``'s table). The runner counts the tensors it was handed by their format
and logical shape; ``plan`` predicts the formats from the config (and a GGUF's header) without
reading a weight, and counts them with the same ``bytes_by_format``.

``--quantization int8|int4`` (round-to-nearest at load, ``model/transforms/rtn.py``) chooses
formats here too (``rtn_format``), so the loader and ``plan`` cannot disagree on them:

    decoder matrices   int8: Q8_0 (34 bytes per 32 weights, 8.5 bits)
                       int4: Q4_1 (20 bytes per 32 weights, 5.0 bits)
    embeddings, head   Q8_0 under either scheme (the head's errors reach every logit; the
                       table is read a row per token, so its bytes cost memory, not time)
    norms, biases      float32

Torch-free: ``plan`` imports it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import gguf

from tailserve.config import (
    QUANTIZATIONS,
    RTN_BLOCK,
    ModelConfig,
    check_quantization_group_size,
)
from tailserve.errors import ConfigError, ModelLoadError
from tailserve.families import FAMILIES

if TYPE_CHECKING:
    import torch

FLOAT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
RTN_FORMATS: dict[str, str] = {"int8": "Q8_0", "int4": "Q4_1"}
RTN_TABLE_FORMAT = "Q8_0"  # embeddings and the LM head, under either scheme
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def block_layout(fmt: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml block format, by name."""
    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    except KeyError:
        raise ValueError(f"unknown weight format {fmt!r}") from None


def tensor_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor of logical ``shape`` stored as ``fmt``."""
    if fmt in FLOAT_BYTES:
        return math.prod(shape) * FLOAT_BYTES[fmt]
    block, size = block_layout(fmt)
    if shape[-1] % block:
        raise ValueError(f"{fmt} stores rows in blocks of {block}; a row of {shape[-1]} values "
                         "is not a whole number of them")
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def bytes_by_format(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """Total bytes per format of ``(format, logical shape)`` pairs."""
    out: Counter[str] = Counter()
    for fmt, shape in tensors:
        out[fmt] += tensor_bytes(fmt, shape)
    return dict(out)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a supported model has, with its shape."""
    h, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    q_dim = config.num_attention_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_dim, h),
            p + "self_attn.k_proj.weight": (kv_dim, h),
            p + "self_attn.v_proj.weight": (kv_dim, h),
            p + "self_attn.o_proj.weight": (h, q_dim),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.sandwich_norms:
            shapes |= {
                p + "pre_feedforward_layernorm.weight": (h,),
                p + "post_feedforward_layernorm.weight": (h,),
            }
        if config.qk_norm:
            shapes |= {
                p + "self_attn.q_norm.weight": (config.head_dim,),
                p + "self_attn.k_norm.weight": (config.head_dim,),
            }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_dim,),
                p + "self_attn.k_proj.bias": (kv_dim,),
                p + "self_attn.v_proj.bias": (kv_dim,),
            }
    return shapes


def stored_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``expected_weight_shapes`` as the family's checkpoints store them: the parts of each
    fused projection (``Family.fused``: Phi-3's qkv_proj, gate_up_proj) as one tensor of their
    rows stacked, under the fused name."""
    shapes = expected_weight_shapes(config)
    fused = FAMILIES[config.architecture].fused
    for i in range(config.num_hidden_layers):
        for stored, parts in fused.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if not all(name in shapes for name in names):
                    continue
                rows = sum(shapes[name][0] for name in names)
                rest = shapes[names[0]][1:]
                for name in names:
                    del shapes[name]
                shapes[f"model.layers.{i}.{stored}.{kind}"] = (rows, *rest)
    return shapes


Splitter = Callable[[str, "torch.Tensor"], list[tuple[str, "torch.Tensor"]]]


def fused_splitter(config: ModelConfig) -> Splitter | None:
    """The family's fused projections (``Family.fused``) split into the canonical names as they
    are read, from a Hugging Face folder or a GGUF alike; every other tensor passes as it is.
    A fused weight splits by output rows (float values, or a GGUF's packed blocks, whose first
    axis is rows too) into the shapes the canonical names have. None for a family that stores
    none fused (the reader then looks at no name)."""
    fused = FAMILIES[config.architecture].fused
    if not fused:
        return None
    shapes = expected_weight_shapes(config)

    def split(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        prefix, _, rest = key.partition(".layers.")
        layer, _, local = rest.partition(".")
        stored, _, kind = local.rpartition(".")
        if not rest or stored not in fused:
            return [(key, tensor)]
        names = [f"{prefix}.layers.{layer}.{part}.{kind}" for part in fused[stored]]
        rows = [shapes[name][0] if name in shapes else 0 for name in names]
        if sum(rows) != tensor.shape[0] or 0 in rows:
            raise ModelLoadError(
                f"{key} has {tensor.shape[0]} rows; the config implies "
                f"{' + '.join(map(str, rows))} for {', '.join(fused[stored])}"
            )
        return list(zip(names, tensor.split(rows), strict=True))

    return split


def rtn_format(name: str, shape: tuple[int, ...], quantization: str) -> str:
    """The format ``--quantization`` stores the weight ``name`` in (module docstring)."""
    if quantization not in RTN_FORMATS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                          f"got {quantization!r}")
    if len(shape) != 2:
        return "float32"
    return RTN_TABLE_FORMAT if name in TABLES else RTN_FORMATS[quantization]


def check_rtn_shapes(config: ModelConfig, quantization: str, group_size: int,
                     source: str = "the model") -> None:
    """Every matrix ``--quantization`` packs has rows that split into whole groups; raised
    before a weight is read, with the numbers."""
    check_quantization_group_size(group_size)
    for name, shape in expected_weight_shapes(config).items():
        if rtn_format(name, shape, quantization) in FLOAT_BYTES:
            continue
        cols = shape[1]
        group = cols if group_size == -1 else group_size
        if cols % group or cols % RTN_BLOCK:
            raise ConfigError(
                f"--quantization {quantization} with group size {group_size}: {name} in "
                f"{source} has rows of {cols} values, not a multiple of {group}"
                + (f" (nor of the {RTN_BLOCK}-value blocks)" if cols % RTN_BLOCK else ""))


def planned_storage(
    config: ModelConfig, *, dtype: str = "bfloat16", quantization: str | None = None,
    gguf_types: dict[str, str] | None = None, compute_dtype: str | None = None,
) -> list[tuple[str, tuple[int, ...]]]:
    """``(format, shape)`` of every weight as the loader stores it: the formats ``gguf_types``
    names (a GGUF's HF-named tensors as kept packed: a block format, else float32), else
    ``quantization``'s (``rtn_format``), else ``dtype`` for every tensor (a checkpoint keeps
    its dtype) but the norms and biases, which are in ``compute_dtype`` where it is given (the
    runner's ``cast_for_storage``: on CPU 16-bit weights compute in float32)."""
    out = []
    for name, shape in expected_weight_shapes(config).items():
        if gguf_types is not None:
            fmt = gguf_types.get(name, "float32")
        elif quantization is not None:
            fmt = rtn_format(name, shape, quantization)
        elif compute_dtype is not None and len(shape) == 1:
            fmt = compute_dtype
        else:
            fmt = dtype
        out.append((fmt, shape))
    return out


__all__ = [
    "FLOAT_BYTES",
    "QUANTIZATIONS",
    "RTN_BLOCK",
    "RTN_FORMATS",
    "block_layout",
    "bytes_by_format",
    "check_rtn_shapes",
    "expected_weight_shapes",
    "fused_splitter",
    "planned_storage",
    "rtn_format",
    "stored_weight_shapes",
    "tensor_bytes",
]
