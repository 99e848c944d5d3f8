"""The ggml block formats the CPU kernels read as stored, and how a packed tensor is shaped.

A packed weight is a uint8 tensor ``[rows, blocks_per_row, type_size]``: each row is a run of
whole ggml blocks, byte for byte as in the GGUF file. ``type_size`` differs between every
supported format, so the tensor's shape alone names its format (``kernels/csrc/
quant_linear.cpp`` reads it the same way) and nothing else has to travel with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    block_size: int  # values per block
    type_size: int  # bytes per block


def _fmt(t: gguf.GGMLQuantizationType) -> BlockFormat:
    block, size = gguf.GGML_QUANT_SIZES[t]
    return BlockFormat(t.name, t, block, size)


Q = gguf.GGMLQuantizationType
PACKED_FORMATS: dict[gguf.GGMLQuantizationType, BlockFormat] = {
    t: _fmt(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
}
_BY_TYPE_SIZE = {f.type_size: f for f in PACKED_FORMATS.values()}
assert len(_BY_TYPE_SIZE) == len(PACKED_FORMATS), "type sizes must name the formats"


def is_packed(t: torch.Tensor) -> bool:
    """A tensor of GGUF blocks (``[rows, blocks, type_size]`` uint8) rather than values."""
    return t.dtype == torch.uint8 and t.dim() == 3 and t.shape[2] in _BY_TYPE_SIZE


def format_of(t: torch.Tensor) -> BlockFormat:
    if not is_packed(t):
        raise ValueError(f"not a packed GGUF tensor: {t.dtype} {tuple(t.shape)}")
    return _BY_TYPE_SIZE[t.shape[2]]


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of the values a tensor holds: ``[rows, in_features]`` for a packed one."""
    if is_packed(t):
        return (t.shape[0], t.shape[1] * format_of(t).block_size)
    return tuple(t.shape)


def pack_rows(raw: np.ndarray, fmt: BlockFormat, shape: tuple[int, int]) -> torch.Tensor:
    """A file's bytes of a ``[rows, cols]`` tensor as a packed tensor that owns its memory."""
    rows, cols = shape
    blocks = cols // fmt.block_size
    return torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(
        rows, blocks, fmt.type_size)


def dequantize_reference(t: torch.Tensor) -> torch.Tensor:
    """The float32 values of a packed tensor by ``gguf``'s numpy code: the reference the
    kernels are tested against (and the float32 path computes with)."""
    fmt = format_of(t)
    rows, cols = logical_shape(t)
    values = gguf.dequantize(t.reshape(rows, -1).numpy(), fmt.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, cols)
