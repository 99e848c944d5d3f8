"""The ggml block formats the CPU kernels read as stored, and how a packed tensor is shaped.

A packed weight is a uint8 tensor ``[rows, blocks_per_row, type_size]``: each row is a run of
whole ggml blocks, byte for byte as in the GGUF file. ``type_size`` differs between every
supported format, so the tensor's shape alone names its format (``kernels/csrc/
quant_blocks.h`` reads it the same way) and nothing else has to travel with it.

The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are served *tiled* (``tile_blocks``, at
load): the same bytes regrouped per 16 output rows so the kernels' integer dot products read
16 rows in one vector load, ``[rows / 16, blocks_per_row, 16, type_size]`` (4-D, so the shape
still tells the two forms apart; the layout is drawn in ``kernels/csrc/quant_tiled.cpp``).
A matrix whose row count is not a multiple of 16 stays as stored (no padding rows: the shape
then gives the exact row count).
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


TILE_ROWS = 16  # output rows per tile
TILED_TYPE_SIZES = frozenset(PACKED_FORMATS[t].type_size
                             for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))


def is_tiled(t: torch.Tensor) -> bool:
    """GGUF blocks in tiles of 16 rows (``[rows / 16, blocks, 16, type_size]`` uint8)."""
    return (t.dtype == torch.uint8 and t.dim() == 4 and t.shape[2] == TILE_ROWS
            and t.shape[3] in TILED_TYPE_SIZES)


def is_packed(t: torch.Tensor) -> bool:
    """A tensor of GGUF blocks (``[rows, blocks, type_size]`` uint8, or tiled) rather than
    values."""
    return (t.dtype == torch.uint8 and t.dim() == 3 and t.shape[2] in _BY_TYPE_SIZE) or is_tiled(t)


def format_of(t: torch.Tensor) -> BlockFormat:
    if not is_packed(t):
        raise ValueError(f"not a packed GGUF tensor: {t.dtype} {tuple(t.shape)}")
    return _BY_TYPE_SIZE[t.shape[-1]]


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of the values a tensor holds: ``[rows, in_features]`` for a packed one."""
    if is_tiled(t):
        return (t.shape[0] * TILE_ROWS, t.shape[1] * format_of(t).block_size)
    if is_packed(t):
        return (t.shape[0], t.shape[1] * format_of(t).block_size)
    return tuple(t.shape)


def tileable(t: torch.Tensor) -> bool:
    """Stored blocks ``tile_blocks`` regroups: a 32-value format, rows a multiple of 16."""
    return (is_packed(t) and not is_tiled(t) and t.shape[2] in TILED_TYPE_SIZES
            and t.shape[0] % TILE_ROWS == 0)


def _fields(fmt: BlockFormat) -> tuple[bool, bool, int]:
    """(has the fp16 offset m, has the 32 fifth bits qh, bytes of qs) of a 32-value format."""
    name = fmt.name
    return name in ("Q4_1", "Q5_1"), name in ("Q5_0", "Q5_1"), 32 if name == "Q8_0" else 16


def tile_blocks(t: torch.Tensor) -> torch.Tensor:
    """Stored blocks ``[rows, blocks, type_size]`` -> the tiled form (the same bytes, one new
    tensor); a tensor that is not ``tileable`` (or already tiled) comes back unchanged."""
    if not tileable(t):
        return t
    fmt = format_of(t)
    has_m, has_h, qs_bytes = _fields(fmt)
    rows, nb, ts = t.shape
    # [tiles, blocks, 16 rows, type_size]: each block's field for the 16 rows side by side
    x = t.numpy().reshape(rows // TILE_ROWS, TILE_ROWS, nb, ts).transpose(0, 2, 1, 3)
    tiles = rows // TILE_ROWS
    out = [x[..., 0:2].reshape(tiles, nb, 32)]  # d[16]
    at = 2
    if has_m:
        out.append(x[..., 2:4].reshape(tiles, nb, 32))
        at = 4
    if has_h:  # qh (bit k: value k) -> 8 masks, bit 4r+i of mask c: value 4c+i of row r
        bits = np.unpackbits(np.ascontiguousarray(x[..., at:at + 4]), axis=-1, bitorder="little")
        bits = bits.reshape(tiles, nb, TILE_ROWS, 8, 4).transpose(0, 1, 3, 2, 4)
        out.append(np.packbits(bits.reshape(tiles, nb, 8, 64), axis=-1, bitorder="little")
                   .reshape(tiles, nb, 64))
        at += 4
    qs = x[..., at:at + qs_bytes].reshape(tiles, nb, TILE_ROWS, qs_bytes // 4, 4)
    out.append(qs.transpose(0, 1, 3, 2, 4).reshape(tiles, nb, TILE_ROWS * qs_bytes))
    tiled = np.concatenate(out, axis=-1).reshape(tiles, nb, TILE_ROWS, ts)
    return torch.from_numpy(np.ascontiguousarray(tiled))


def untile_blocks(t: torch.Tensor) -> torch.Tensor:
    """The stored form ``[rows, blocks, type_size]`` of a tiled tensor (others unchanged)."""
    if not is_tiled(t):
        return t
    fmt = format_of(t)
    has_m, has_h, qs_bytes = _fields(fmt)
    tiles, nb, _, ts = t.shape
    x = t.numpy().reshape(tiles, nb, TILE_ROWS * ts)
    parts = [x[..., 0:32].reshape(tiles, nb, TILE_ROWS, 2)]
    at = 32
    if has_m:
        parts.append(x[..., 32:64].reshape(tiles, nb, TILE_ROWS, 2))
        at = 64
    if has_h:
        bits = np.unpackbits(np.ascontiguousarray(x[..., at:at + 64]).reshape(tiles, nb, 8, 8),
                             axis=-1, bitorder="little")
        bits = bits.reshape(tiles, nb, 8, TILE_ROWS, 4).transpose(0, 1, 3, 2, 4)
        parts.append(np.packbits(bits.reshape(tiles, nb, TILE_ROWS, 32), axis=-1,
                                 bitorder="little"))
        at += 64
    qs = x[..., at:at + TILE_ROWS * qs_bytes].reshape(tiles, nb, qs_bytes // 4, TILE_ROWS, 4)
    parts.append(qs.transpose(0, 1, 3, 2, 4).reshape(tiles, nb, TILE_ROWS, qs_bytes))
    blocks = np.concatenate(parts, axis=-1)  # [tiles, blocks, 16, type_size]
    stored = blocks.transpose(0, 2, 1, 3).reshape(tiles * TILE_ROWS, nb, ts)
    return torch.from_numpy(np.ascontiguousarray(stored))


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
    values = gguf.dequantize(untile_blocks(t).reshape(rows, -1).numpy(), fmt.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, cols)
