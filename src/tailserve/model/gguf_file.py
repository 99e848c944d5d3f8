"""The GGUF file itself: its header, metadata and tensor table, parsed with ``struct`` over a
read-only memory map (``read_gguf``), and its tensors read on demand (``GGUFFile``).

Parsed here rather than with ``gguf.GGUFReader``: that reader builds a numpy view for every
element of the vocabulary and merge arrays (~150k strings), which costs ~5 s on the bundled 135M
model, while walking the header with ``struct`` takes ~50 ms. Dequantizing blocks is left to
``gguf.dequantize``, and the layout constants (value types, block sizes) come from the ``gguf``
package too. Shapes are in torch order (GGUF lists ``ne0``, the input features, first).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from tailserve.errors import ModelLoadError
from tailserve.model.quant.formats import PACKED_FORMATS, pack_rows

_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; no file in circulation still does
_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
# Longer string arrays (the vocabulary, the merges) are only counted: nothing here needs their
# contents, and the tokenizer builder reads them itself.
_MAX_STRING_ARRAY = 1024
_BLOCKS_PER_WIDE_ROW = 512  # 16 such rows of Q8_0 or Q4 blocks: ~1 MB of float32 per group


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings that was counted but not read (see ``_MAX_STRING_ARRAY``)."""

    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: gguf.GGMLQuantizationType
    offset: int  # absolute, from the start of the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF header plus a read-only memory map of the file; tensors are read on demand."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    blob: mmap.mmap  # the whole file, read-only; pages are read when a tensor is dequantized

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a writable, contiguous float32 CPU tensor in torch order."""
        info = self.tensors[name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[info.ggml_type]
        if info.nbytes == 0:
            return torch.zeros(info.shape)
        raw = np.frombuffer(self.blob, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        # gguf.dequantize expands the last axis from bytes to values and loops in Python over
        # groups of 16 rows of that axis. Rows are independent runs of whole blocks, so several
        # are handed over as one wide row: same values, ~1.6x faster on the bundled model,
        # and temporaries stay cache-sized (16 wide rows of <= _BLOCKS_PER_WIDE_ROW blocks).
        blocks_per_row = info.shape[-1] // block_size
        num_rows = info.nbytes // type_size // blocks_per_row
        rows_per_wide_row = max(1, _BLOCKS_PER_WIDE_ROW // blocks_per_row)
        while num_rows % rows_per_wide_row:
            rows_per_wide_row -= 1
        wide = raw.reshape(num_rows // rows_per_wide_row, -1)
        values = gguf.dequantize(wide, info.ggml_type)
        # F32 comes back as a view of the read-only map: copy it so the weights own their memory.
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values, dtype=np.float32, order="C")
        return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(info.shape)

    def packed(self, name: str) -> torch.Tensor:
        """Matrix ``name`` as its stored blocks: uint8 ``[rows, blocks, type_size]``, a copy."""
        info = self.tensors[name]
        fmt = PACKED_FORMATS[info.ggml_type]
        raw = np.frombuffer(self.blob, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows, cols = info.shape
        return pack_rows(raw, fmt, (rows, cols))


def read_gguf(path: str) -> GGUFFile:
    """Parse ``path``'s metadata and tensor table; raises ``ModelLoadError`` if it is not GGUF."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if size < 24 or magic != b"GGUF":
            raise ModelLoadError(
                f"{path} is not a GGUF file ({size} bytes starting {magic!r}, expected b'GGUF')"
            )
        # The map outlives the file object: mmap keeps its own duplicate of the descriptor.
        blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise ModelLoadError(
            f"{path} is GGUF version {version}; supported versions: {_SUPPORTED_VERSIONS}"
        )
    try:
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            metadata[key], pos = _read_value(blob, pos + 4, value_type)

        table: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(tensor_count):
            name, pos = _read_string(blob, pos)
            (ndim,) = struct.unpack_from("<I", blob, pos)
            dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            table.append((name, tuple(reversed(dims)), ggml_type, offset))
    except ModelLoadError:
        raise
    except (struct.error, ValueError) as exc:  # a count or length pointing past the end
        raise ModelLoadError(f"{path} is a truncated or corrupt GGUF file: {exc}") from exc

    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, type_id, offset in table:
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {type_id}") from None
        if not shape or shape[-1] % block_size:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {shape}, whose rows are not whole "
                f"{ggml_type.name} blocks of {block_size} values"
            )
        numel = int(np.prod(shape))
        nbytes = numel // block_size * type_size
        if data_start + offset + nbytes > size:
            raise ModelLoadError(
                f"{path}: tensor {name} ends at byte {data_start + offset + nbytes} but the file "
                f"has {size} bytes (truncated download?)"
            )
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, data_start + offset, nbytes)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, blob=blob)


def _read_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    start = pos + 8
    return blob[start : start + length].decode("utf-8", errors="replace"), start + length


def _read_value(blob: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    """One metadata value and the offset just past it."""
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[gguf.GGUFValueType(value_type)]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == gguf.GGUFValueType.STRING:
        return _read_string(blob, pos)
    if value_type != gguf.GGUFValueType.ARRAY:
        raise ModelLoadError(f"unknown GGUF metadata value type {value_type} at byte {pos}")
    element_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[gguf.GGUFValueType(element_type)]
        width = struct.calcsize(fmt)
        values = np.frombuffer(blob, dtype=np.dtype(fmt), count=count, offset=pos)
        return values.tolist() if count <= _MAX_STRING_ARRAY else values, pos + count * width
    if element_type == gguf.GGUFValueType.STRING:
        if count <= _MAX_STRING_ARRAY:
            strings = []
            for _ in range(count):
                text, pos = _read_string(blob, pos)
                strings.append(text)
            return strings, pos
        for _ in range(count):  # variable length: walking the lengths is the only way past
            pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
        return StringArray(count), pos
    # Arrays of arrays exist in the spec but in no metadata of the architectures supported here.
    raise ModelLoadError(f"unsupported GGUF metadata array element type {element_type}")
