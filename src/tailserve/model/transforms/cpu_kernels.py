"""``apply_cpu_kernels``: swap a float32 CPU model's modules for their compiled-kernel forms.

=================  ==================  ==============================================
plain module       swapped for          computes, in one op each
=================  ==================  ==============================================
``nn.Linear``      ``KernelLinear``     panel kernel (decode rows), oneDNN (prefill)
``RMSNorm``        ``FusedRMSNorm``     RMSNorm, with its residual add, in place
``SiluAndMul``     ``FusedSiluAndMul``  SiLU of the gate times the up projection
``ApplyRope``      ``FusedApplyRope``   rotate-half rope on q and k, in place
=================  ==================  ==============================================

A model that stores its weights in 16 bits (``RunnerConfig.dtype``) and computes in float32
gets ``Linear16`` and ``WideEmbedding`` for those (``linear16.py``).

The fused forms need the compiled ``torch.ops.tailserve`` ops (``compiled``); ``KernelLinear``
is applied without them too where torch has oneDNN (its blocked GEMM and a weight reordered
once beat ``F.linear`` for every row count). Only exact types are swapped: a subclass may
compute something else, and is left to run as written. ``CpuDecodeGraph`` is built from the
swapped modules.
"""

from __future__ import annotations

import logging
import typing
from collections import Counter

import torch
from torch import nn

from tailserve.model.layers import ApplyRope, ResidualNorm, RMSNorm, SiluAndMul
from tailserve.model.transforms.kernel_linear import KernelLinear
from tailserve.model.transforms.linear16 import (
    HALF_DTYPES,
    Linear16,
    WideEmbedding,
    computes_in_float32,
    share_tied_table,
)
from tailserve.model.transforms.report import TransformReport

log = logging.getLogger(__name__)


class FusedRMSNorm(ResidualNorm):
    """``RMSNorm`` on ``torch.ops.tailserve.rms_norm`` / ``fused_add_rms_norm``; same weight.

    ``norm(x, residual)`` works in place on both (x is the layer's fresh output, residual the
    model's own stream) and returns them: ``(norm(x + residual), x + residual)``.
    """

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tailserve.rms_norm(x, self.weight, self.eps)

    def add_normalize(self, x: torch.Tensor,
                      residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.tailserve.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class FusedSiluAndMul(nn.Module):
    """``SiluAndMul`` as one pass: [tokens, 2 * I] -> [tokens, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tailserve.silu_and_mul(x)


class FusedApplyRope(nn.Module):
    """``ApplyRope`` in place on x (float32 [tokens, heads, head_dim]); returns x itself."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        torch.ops.tailserve.rope_(x, cos, sin)
        return x


def apply_cpu_kernels(model: nn.Module, *, compiled: bool) -> TransformReport:
    """Swap a float32 CPU model's modules for their faster forms, in place; what it did.

    ``compiled``: the ``torch.ops.tailserve`` ops are built (``cpu_ops_available()``). Another
    compute dtype or device is left as it is (empty report): the kernels compute in float32 on
    CPU (their weights may be 16-bit).
    """
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or not computes_in_float32(model):
        return TransformReport()
    # Parameters owned by more than one module (a tied LM head is the embedding table).
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    onednn = torch.backends.mkldnn.is_available()
    swapped: Counter[str] = Counter()
    added = 0
    # By name, one module at a time: a weight the swap lets go is freed before the next
    # linear's copies are made, so the transform never holds a third copy of the model.
    for name in [name for name, _ in model.named_modules() if name]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = _replacement(getattr(parent, child), owners, compiled=compiled, onednn=onednn)
        if new is None:
            continue
        swapped[type(getattr(parent, child)).__name__] += 1
        setattr(parent, child, new)
        if isinstance(new, KernelLinear | Linear16):
            added += new.bytes_added
    added -= share_tied_table(model)
    report = TransformReport(bytes_added=added, swapped=dict(swapped))
    log.debug("CPU kernels applied: %s", report)
    return report


def _replacement(
    module: nn.Module, owners: Counter[int], *, compiled: bool, onednn: bool
) -> nn.Module | None:
    """The faster form of one module, or None to keep it (exact types only)."""
    kind = type(module)
    if kind in (nn.Linear, nn.Embedding) and module.weight.dtype in HALF_DTYPES:
        if not compiled:  # 16-bit weights with float32 compute exist only with the kernels
            return None
        if kind is nn.Embedding:
            return WideEmbedding(typing.cast(nn.Embedding, module))
        linear16 = typing.cast(nn.Linear, module)
        return Linear16(linear16, shared=owners[id(linear16.weight)] > 1)
    if kind is nn.Linear and (compiled or onednn):
        linear = typing.cast(nn.Linear, module)
        return KernelLinear(linear, compiled=compiled, onednn=onednn,
                            shared=owners[id(linear.weight)] > 1)
    if not compiled:
        return None
    if kind is RMSNorm:
        return FusedRMSNorm(typing.cast(RMSNorm, module))
    if kind is SiluAndMul:
        return FusedSiluAndMul()
    if kind is ApplyRope:
        return FusedApplyRope()
    return None
