"""``--quantization int8|int4``: group-wise round-to-nearest of a float checkpoint, at load,
into the ggml blocks the packed-GGUF kernels read.

The transform has two halves. Here, each tensor is quantized as the loader reads it
(``RTNQuantizer``, called by ``model/loader.py`` once per safetensors tensor: one tensor's
float32 copy at a time, in slices of rows, never a second copy of the model); then the module
swap is ``apply_gguf_weights`` (``gguf_linear.py``), the one a packed GGUF gets: the same
``GGUFLinear`` / ``GGUFEmbedding`` modules, the same ``quant_linear`` kernels, the same
one-call decode. The formats per weight are ``weight_storage.rtn_format``'s (int8: Q8_0; int4:
Q4_1; embeddings and LM head Q8_0).

Group-wise RTN over a group of G values (G a multiple of 32, or a whole row with -1):

    Q8_0  d = max|x| / 127,  q = round(x / d) in [-127, 127],  x ~ q d
    Q4_1  m = min x,  d = (max x - m) / 15,  q = round((x - m) / d) in [0, 15],  x ~ q d + m
    Q4_0  d = -x* / 8 with x* the value of largest |x|,  q = round(x / d) + 8 in [0, 15],
          x ~ (q - 8) d   (kept for the comparison below)

(ggml's reference rules: q from the float32 d and m, which are then stored as fp16.)

G = 32 is exactly ggml's reference quantization of that format (tested byte for byte against
``gguf.quantize``). A larger G is stored as 32-value blocks that each repeat their group's
scale (and minimum): the values are the group-wise RTN's exactly, but the bytes are those of
G = 32 -- the kernels read one scale per 32 values, so a larger group saves no memory and only
loses accuracy. It exists to reproduce a group-128 scheme, not to save bytes.

Why Q4_1 for int4: it spends 5.0 bits per weight (a scale and a minimum per block) against
Q4_0's 4.5, 11% more bytes, for a lower error than that buys elsewhere: RTN relative RMS error
on the bundled model's Q8_0 embedding table (near-continuous values) 0.090 vs 0.111 (-19%), on
Laplace-distributed values -14%, on Gaussian ones -9%; perplexity of the bundled model's bf16
checkpoint +10% with Q4_0 (benchmarks/notes/weights.md). A block's range from its minimum to its
maximum fits the skewed blocks on which Q4_0's grid, symmetric about zero, leaves levels unused.
"""

from __future__ import annotations

import time

import torch

from tailserve.config import ModelConfig
from tailserve.model.weight_storage import FLOAT_BYTES, RTN_BLOCK, check_rtn_shapes, rtn_format

_ROWS_PER_SLICE = 1024  # rows quantized at once: bounds the float32 temporaries


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = x.shape
    group = cols if group_size == -1 else group_size
    return x.view(rows, cols // group, group)


def _per_block(v: torch.Tensor, cols: int) -> torch.Tensor:
    """A per-group value ``[rows, groups, 1]`` repeated for each 32-value block of its group:
    ``[rows, blocks, 1]``."""
    rows, groups, _ = v.shape
    return v.expand(rows, groups, cols // groups // RTN_BLOCK).reshape(rows, -1, 1)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.uint8)  # [rows, blocks, 2], little-endian as in ggml


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 32] values 0..15 -> ggml's 16 bytes per block (low nibble: value j,
    high nibble: value j + 16)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / d, 0.0)


def quantize_q8_0(x: torch.Tensor, group_size: int = RTN_BLOCK) -> torch.Tensor:
    rows, cols = x.shape
    g = _groups(x, group_size)
    d = g.abs().amax(-1, keepdim=True) / 127
    v = g * _inverse(d)
    q = (v.sign() * (v.abs() + 0.5).floor()).clamp(-127, 127)  # C's roundf, as ggml
    q = q.to(torch.int8).view(rows, -1, RTN_BLOCK)
    return torch.cat([_fp16_bytes(_per_block(d.half(), cols)), q.view(torch.uint8)], dim=2)


def quantize_q4_1(x: torch.Tensor, group_size: int = RTN_BLOCK) -> torch.Tensor:
    rows, cols = x.shape
    g = _groups(x, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((g - lo) * _inverse(d) + 0.5).floor().clamp(0, 15).view(rows, -1, RTN_BLOCK)
    return torch.cat([_fp16_bytes(_per_block(d.half(), cols)),
                      _fp16_bytes(_per_block(lo.half(), cols)), _nibbles(q)], dim=2)


def quantize_q4_0(x: torch.Tensor, group_size: int = RTN_BLOCK) -> torch.Tensor:
    rows, cols = x.shape
    g = _groups(x, group_size)
    d = g.gather(-1, g.abs().argmax(-1, keepdim=True)) / -8
    q = (g * _inverse(d) + 8.5).floor().clamp(0, 15).view(rows, -1, RTN_BLOCK)
    return torch.cat([_fp16_bytes(_per_block(d.half(), cols)), _nibbles(q)], dim=2)


QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1, "Q4_0": quantize_q4_0}


@torch.no_grad()
def quantize_rtn(w: torch.Tensor, fmt: str, group_size: int = RTN_BLOCK) -> torch.Tensor:
    """A ``[rows, cols]`` float matrix as packed ``fmt`` blocks ``[rows, cols / 32,
    type_size]`` (``model/quant/formats.py``), group-wise round-to-nearest."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_rtn takes a float matrix, got {w.dtype} {tuple(w.shape)}")
    quantize = QUANTIZERS[fmt]
    slices = [quantize(w[r:r + _ROWS_PER_SLICE].float(), group_size)
              for r in range(0, w.shape[0], _ROWS_PER_SLICE)]
    return torch.cat(slices) if len(slices) > 1 else slices[0]


class RTNQuantizer:
    """The loader's per-tensor hook: a checkpoint tensor as ``--quantization`` stores it.
    Built from the config, so an unsupported group size or a row that does not split into
    whole groups is a ``ConfigError`` before the first tensor is read."""

    def __init__(self, config: ModelConfig, quantization: str, group_size: int,
                 source: str = "the model") -> None:
        check_rtn_shapes(config, quantization, group_size, source)
        self.config = config
        self.quantization = quantization
        self.group_size = group_size
        self.seconds = 0.0  # spent quantizing, for the start-up log
        self.packed: dict[str, int] = {}  # matrices per format

    def describe(self) -> str:
        formats = ", ".join(f"{n} {f}" for f, n in sorted(self.packed.items()))
        return (f"--quantization {self.quantization} (group {self.group_size}): {formats} "
                f"matrices, round-to-nearest in {self.seconds:.1f} s")

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return tensor  # a tied copy some exports save; the loader drops it
        fmt = rtn_format(name, tuple(tensor.shape), self.quantization)
        if fmt in FLOAT_BYTES:
            return tensor.float().contiguous()  # norms and biases: float32, as computed in
        t0 = time.perf_counter()
        packed = quantize_rtn(tensor, fmt, self.group_size)
        self.seconds += time.perf_counter() - t0
        self.packed[fmt] = self.packed.get(fmt, 0) + 1
        return packed


__all__ = ["QUANTIZERS", "RTNQuantizer", "quantize_q4_0", "quantize_q4_1", "quantize_q8_0",
           "quantize_rtn"]
