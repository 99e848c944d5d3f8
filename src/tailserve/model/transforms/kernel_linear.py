"""KernelLinear: a CPU float32 linear on the compiled panel kernel and oneDNN's blocked GEMM.

A decode step is a matrix product of few rows: at one row it is bound by reading every weight
once, at tens of rows by arithmetic, and MKL/oneDNN serve both poorly on an AVX2 CPU (MKL reads
the weights at 3-4 GB/s at M <= 16; oneDNN reaches 45-75 GFLOPS at M = 16-64). Decode-sized
inputs therefore go to the compiled panel kernel, on a copy of the weight in panels of 16
output columns ``[out/16, in, 16]``: ~15 GB/s at one row, 60-110 GFLOPS at 12-96 rows. Prefill
chunks go to oneDNN with the weight reordered once into its blocked layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many input rows a CPU linear runs the panel kernel; above it oneDNN's blocked
# GEMM is as fast or faster. Measured on a 2-core AVX2 CPU over the default model's 121
# linears with weights streamed from memory (benchmarks/notes/cpu_kernels.md, "CPU kernels"): panel
# 1.3-1.55x oneDNN at 9-64 rows, 1.2x at 96, even at 128, 0.9x at 512.
PANEL_MAX_ROWS = 128
# Weights without a panel copy (output count not a multiple of 16) take the skinny kernel,
# which reads W as stored, up to this many rows.
SKINNY_MAX_ROWS = 8


def panel_weight(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/16, in, 16]: for each 16 output columns, their weights k by k."""
    out_f, in_f = w.shape
    return w.view(out_f // 16, 16, in_f).transpose(1, 2).contiguous()


def onednn_rows_bucket(rows: int) -> int:
    """Row count a oneDNN linear actually runs with: 8s up to 64, then 64s.

    oneDNN (through torch's ideep) keeps state for every input shape it has seen; with the
    row count varying every step (decode batch sizes, prefill chunks) RSS grew by ~500 MB over
    500 mixed requests (tests/test_steady_memory.py; with every row count up to 64 exact,
    still +92 MB). A few buckets bound it (measured: +23 MB, flat). They are fine up to 64
    rows (decode batches of weights without a panel copy): a linear's time grows with its
    rows (17 rows take 65% of 32 rows' time), so buckets of 16 wasted up to a third of it.
    """
    if rows <= 64:
        return -(-rows // 8) * 8
    return -(-rows // 64) * 64


class KernelLinear(nn.Module):
    """The same product as the ``nn.Linear`` it replaces, through the fastest path for the rows.

    It owns up to two copies of the weight: ``panel`` (the compiled ops are built and the
    output count is a multiple of 16) and ``packed`` (oneDNN is built into torch). It keeps the
    original ``weight`` only where a path still reads it (no panel copy: the skinny kernel, or
    no packed copy: ``F.linear``) or where another module shares it (a tied LM head is the
    embedding table), so memory stays at two copies of each weight.
    """

    weight: torch.Tensor | None  # the replaced linear's own weight parameter, where kept
    bias: torch.Tensor | None  # the replaced linear's own bias parameter

    def __init__(self, linear: nn.Linear, *, compiled: bool, onednn: bool, shared: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self._weight_bytes = w.numel() * w.element_size()
        # [out/16, in, 16] copy for the panel kernel
        self.panel = panel_weight(w) if compiled and self.out_features % 16 == 0 else None
        # Batch hint 64: near the typical decode batch; the layout serves every M.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 64) if onednn else None
        self.skinny = compiled and self.panel is None  # few rows on W as stored
        needs_weight = self.skinny or self.packed is None
        self.weight = linear.weight if needs_weight or shared else None
        self.bias = linear.bias

    @property
    def bytes_added(self) -> int:
        """Memory beyond the weight it replaced: its copies, less the weight if it let it go."""
        copies = (self.panel is not None) + (self.packed is not None)
        return self._weight_bytes * (copies - (self.weight is None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.panel is not None and rows <= PANEL_MAX_ROWS:
            return torch.ops.tailserve.panel_linear(x, self.panel, self.bias)
        if self.skinny and rows <= SKINNY_MAX_ROWS:
            return torch.ops.tailserve.skinny_linear(x, self.weight, self.bias)
        if self.packed is not None:
            bucket = onednn_rows_bucket(rows)
            if bucket != rows:
                padded = x.new_zeros((bucket, x.shape[1]))
                padded[:rows] = x
                x = padded
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y[:rows]
        assert self.weight is not None  # kept whenever there is no packed copy
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        paths = [p for p, on in (("panel", self.panel is not None), ("skinny", self.skinny),
                                 ("onednn", self.packed is not None)) if on]
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, paths={'+'.join(paths) or 'F.linear'}")
