"""Building blocks of a Llama-family decoder: linears, RMSNorm, SwiGLU, rotary embeddings."""

from __future__ import annotations

import math
import typing
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many input rows a CPU linear runs the panel kernel; above it oneDNN's blocked
# GEMM is as fast or faster. Measured on a 2-core AVX2 CPU over the default model's 121
# linears with weights streamed from memory (benchmarks/RESULTS.md, "CPU kernels"): panel
# 1.3-1.55x oneDNN at 9-64 rows, 1.2x at 96, even at 128, 0.9x at 512.
PANEL_MAX_ROWS = 128
# Weights without a panel copy (output count not a multiple of 16) take the skinny kernel,
# which reads W as stored, up to this many rows.
SKINNY_MAX_ROWS = 8


class Linear(nn.Linear):
    """``nn.Linear`` with faster CPU paths, added by ``prepare_cpu_kernels``.

    A decode step is a matrix product of few rows: at one row it is bound by reading every
    weight once, at tens of rows by arithmetic, and MKL/oneDNN serve both poorly on an AVX2
    CPU (MKL reads the weights at 3-4 GB/s at M <= 16; oneDNN reaches 45-75 GFLOPS at
    M = 16-64). Decode-sized inputs therefore go to the compiled panel kernel, on a copy of
    the weight in panels of 16 output columns ``[out/16, in, 16]``: ~15 GB/s at one row,
    60-110 GFLOPS at 12-96 rows. Prefill chunks go to oneDNN with the weight reordered once
    into its blocked layout. Without either (no compiler, another dtype or device) it is
    plain ``F.linear``.
    """

    skinny: bool = False
    panel: torch.Tensor | None = None  # [out/16, in, 16] copy for the panel kernel
    packed: torch.Tensor | None = None  # oneDNN-blocked copy for many rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.panel is not None and rows <= PANEL_MAX_ROWS:
            return torch.ops.tailserve.panel_linear(x, self.panel, self.bias)
        if self.skinny and rows <= SKINNY_MAX_ROWS:  # no panel copy: W is kept as stored
            return torch.ops.tailserve.skinny_linear(x, self.weight, self.bias)
        if self.packed is not None:
            bucket = onednn_rows_bucket(rows)
            if bucket != rows:
                padded = x.new_zeros((bucket, x.shape[1]))
                padded[:rows] = x
                x = padded
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y[:rows]
        return super().forward(x)


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


def panel_weight(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/16, in, 16]: for each 16 output columns, their weights k by k."""
    out_f, in_f = w.shape
    return w.view(out_f // 16, 16, in_f).transpose(1, 2).contiguous()


def prepare_cpu_kernels(model: nn.Module, use_kernels: bool) -> int:
    """Switch a float32 CPU model's layers to the faster paths; returns the bytes added.

    ``use_kernels`` (the compiled ``torch.ops.tailserve`` ops are built): decode-sized linears
    use the panel kernel on a panel copy of their weight, RMSNorm (with its residual add),
    SiLU-and-mul and rope run as one fused op each. Where oneDNN is built in, every ``Linear``
    also gets its weight in oneDNN's blocked layout for many-row inputs. A weight with both
    copies is never read in its own layout again, so its storage is released, unless another
    module shares it (a tied LM head is the embedding table): memory stays at two copies.
    """
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return 0
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    added = 0
    mkldnn = torch.backends.mkldnn.is_available()
    for module in model.modules():
        # Layers with a fused form say so with a ``use_kernel`` class attribute.
        if hasattr(type(module), "use_kernel"):
            setattr(module, "use_kernel", use_kernels)  # noqa: B010 - typed per class
        if not isinstance(module, Linear):
            continue
        w = module.weight
        nbytes = w.numel() * w.element_size()
        module.skinny = use_kernels
        if use_kernels and module.out_features % 16 == 0:
            module.panel = panel_weight(w.detach())
            added += nbytes
        if mkldnn:
            # Batch hint 64: near the typical decode batch; the layout serves every M.
            module.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
            added += nbytes
        if module.panel is not None and module.packed is not None and owners[id(w)] == 1:
            w.data = torch.empty(0, dtype=w.dtype)
            added -= nbytes
    return added


class RMSNorm(nn.Module):
    """RMSNorm; with ``residual`` it first adds ``x`` into it (the fused form vLLM uses).

    ``norm(x)`` returns the normalized ``x``; ``norm(x, residual)`` returns
    ``(norm(x + residual), x + residual)``, the second being the new residual stream.
    """

    use_kernel: bool = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @typing.overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @typing.overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel:
            if residual is None:
                return torch.ops.tailserve.rms_norm(x, self.weight, self.eps)
            # In place on both: x is this layer's fresh output, residual our own stream.
            torch.ops.tailserve.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in float32 as the reference does, then cast back: bf16 variance loses digits.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SiluAndMul(nn.Module):
    """[tokens, 2 * I] -> [tokens, I]: SiLU of the first half times the second (SwiGLU)."""

    use_kernel: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            return torch.ops.tailserve.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for rope types default, linear and llama3 (float32, [head_dim/2])."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default" or scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        low_ff = float(scaling.get("low_freq_factor", 1.0))
        high_ff = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = old_len / low_ff
        high_wavelen = old_len / high_ff
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half (neox) rotary embedding with a cos/sin table built once for every position."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        # [max_position, head_dim / 2] each
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for this step's positions, [num_tokens, 1, head_dim / 2]; once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False
) -> torch.Tensor:
    """Rotate-half rope on x [num_tokens, num_heads, head_dim], computed in float32.

    ``fused`` (float32 CPU with the kernels built): rotated in place by one op.
    """
    if fused:
        torch.ops.tailserve.rope_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)
