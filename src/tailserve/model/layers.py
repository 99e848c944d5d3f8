"""Building blocks of a Llama-family decoder: RMSNorm, SwiGLU / GeGLU, rotary embeddings; pure
torch.

Faster forms of these (compiled CPU kernels, oneDNN) are swapped in by a model transform
(``tailserve.model.transforms``), never switched on inside them.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ResidualNorm(nn.Module):
    """What every form of RMSNorm answers, the plain module below and the kernel forms that
    transforms swap in: ``norm(x)`` returns the normalized ``x``; ``norm(x, residual)`` first
    adds ``x`` into the residual stream (the fused form vLLM uses) and returns
    ``(norm(x + residual), x + residual)``, the second being the new residual stream. A form
    supplies ``normalize`` and ``add_normalize``; the forms may work in place on ``x`` and
    ``residual``, so callers use what is returned."""

    weight: nn.Parameter
    eps: float

    @typing.overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @typing.overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.normalize(x)
        return self.add_normalize(x, residual)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_normalize(self, x: torch.Tensor,
                      residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class RMSNorm(ResidualNorm):
    """RMSNorm in torch (``ResidualNorm``'s interface)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def add_normalize(self, x: torch.Tensor,
                      residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.normalize(residual), residual

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in float32 as the reference does, then cast back: bf16 variance loses digits.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SiluAndMul(nn.Module):
    """[tokens, 2 * I] -> [tokens, I]: SiLU of the first half times the second (SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[tokens, 2 * I] -> [tokens, I]: tanh-approximated GELU of the first half times the second
    (GeGLU, Gemma's ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# config.json's activation name -> the gated MLP's module (model_features.SERVED_ACTIVATIONS).
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for rope types default, linear, llama3 and freq_factors (float32,
    [head_dim/2])."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default" or scaling is None:
        return inv_freq
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs: each frequency over its factor
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{len(factors)} rope frequency factors for a head of {head_dim} "
                             f"dimensions (want {head_dim // 2})")
        return inv_freq / factors
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
        # [max_position, head_dim / 2] each
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        if torch.get_default_device().type == "meta":
            # A meta build (the runner's) makes the table again on its device; the values are
            # never read here, and computing them on meta would run torch's Python reference
            # ops, whose first use imports torch._dynamo and Triton (model/meta_build.py).
            freqs = torch.empty(max_position, head_dim // 2)
            self.register_buffer("cos", freqs, persistent=False)
            self.register_buffer("sin", torch.empty_like(freqs), persistent=False)
            return
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for this step's positions, [num_tokens, 1, head_dim / 2]; once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [num_tokens, num_heads, head_dim], computed in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class ApplyRope(nn.Module):
    """``apply_rope`` as a module of the attention layer, so a transform can swap it (the fused
    in-place form on CPU). Returns the rotated x, which may be x itself."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)
