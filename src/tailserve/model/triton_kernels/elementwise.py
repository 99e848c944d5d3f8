"""Triton forms of the model's small ops: RMSNorm (with its residual add), rope, SiLU-and-mul.

Why they pay on a GPU: each is a chain of 3-8 torch kernels over the same activations (the
residual add, a square, a mean, an rsqrt, two products, casts), every one a launch and a
round trip through HBM; one kernel reads the row once and writes it once. They round where the
torch forms in ``layers.py`` round (float32 math, the activation dtype at the same points), so
their results equal the reference's up to float32 reassociation.

One program per token row (SiLU-and-mul: per row and column tile); a row of a Llama model
(hidden <= 16k, head_dim <= 256) fits one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(n))


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, eps, stride_o, stride_x, stride_r,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < HIDDEN
    x = tl.load(x_ptr + t * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The new residual stream is x + residual in the activation dtype, as torch rounds it.
        r = tl.load(residual_ptr + t * stride_r + i, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + t * stride_r + i, x, mask=mask)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    # layers.RMSNorm: normalize in float32, cast, then the weight product in the dtype.
    y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + t * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [num_tokens, hidden] into a new tensor."""
    out = torch.empty_like(x)
    _launch_norm(out, x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual = x + residual``, ``x = rms_norm(residual)``."""
    _launch_norm(x, x, residual, weight, eps)


def _launch_norm(
    out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
    eps: float,
) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with unit stride")
    r = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        out, x, r, weight, eps, out.stride(0), x.stride(0), r.stride(0),
        HIDDEN=hidden, BLOCK=_pow2(hidden), HAS_RESIDUAL=residual is not None,
    )


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    jmask = j < HALF
    mask = (h[:, None] < NUM_HEADS) & jmask[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + j, mask=jmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + j, mask=jmask, other=0.0).to(tl.float32)
    first = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty),
             mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty),
             mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope in place on x [num_tokens, num_heads, head_dim] (a strided view of
    the fused qkv is fine); cos, sin: [num_tokens, 1, head_dim / 2]. Returns x."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return x
    if x.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_ needs unit stride along head_dim")
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, HEADS_PAD=_pow2(num_heads), HALF=half, HALF_PAD=_pow2(half),
    )
    return x


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, stride_o, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    gate = tl.load(x_ptr + t * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + INTER + i, mask=mask, other=0.0).to(tl.float32)
    # F.silu(gate) * up: the SiLU is rounded to the dtype before the product, as torch does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * I] -> [num_tokens, I]: SiLU(first half) * second half."""
    num_tokens, width = x.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs rows with unit stride")
    block = min(SILU_BLOCK, _pow2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        out, x, out.stride(0), x.stride(0), INTER=inter, BLOCK=block,
    )
    return out
