"""``apply_triton_kernels``: swap a CUDA model's small ops for their Triton forms.

=================  ===================  ===========================================
plain module       swapped for          computes, in one kernel each
=================  ===================  ===========================================
``RMSNorm``        ``TritonRMSNorm``    RMSNorm, with its residual add, in place
``SiluAndMul``     ``TritonSiluAndMul`` SiLU of the gate times the up projection
``ApplyRope``      ``TritonApplyRope``  rotate-half rope on q and k, in place
=================  ===================  ===========================================

Linears stay ``nn.Linear`` (cuBLAS is the right GEMM); attention is the backend's
(``attention/triton.py``). Only exact types are swapped, as in ``apply_cpu_kernels``. The
kernels are imported when the transform runs, not with this module: Triton decides at a
kernel's definition whether it is compiled or interpreted.
"""

from __future__ import annotations

import logging
import typing
from collections import Counter

import torch
from torch import nn

from tailserve.model.layers import ApplyRope, ResidualNorm, RMSNorm, SiluAndMul
from tailserve.model.transforms.report import TransformReport

log = logging.getLogger(__name__)


class TritonRMSNorm(ResidualNorm):
    """``RMSNorm`` in one kernel; ``norm(x, residual)`` works in place on both and returns
    ``(norm(x + residual), x + residual)`` as the plain module does."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        from tailserve.model.triton_kernels import elementwise

        return elementwise.rms_norm(x, self.weight, self.eps)

    def add_normalize(self, x: torch.Tensor,
                      residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from tailserve.model.triton_kernels import elementwise

        elementwise.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class TritonSiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tailserve.model.triton_kernels import elementwise

        return elementwise.silu_and_mul(x)


class TritonApplyRope(nn.Module):
    """Rope in place on x (a view of the fused qkv); returns x itself."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from tailserve.model.triton_kernels import elementwise

        return elementwise.rope_(x, cos, sin)


_SWAPS: dict[type[nn.Module], typing.Callable[[nn.Module], nn.Module]] = {
    RMSNorm: lambda m: TritonRMSNorm(typing.cast(RMSNorm, m)),
    SiluAndMul: lambda m: TritonSiluAndMul(),
    ApplyRope: lambda m: TritonApplyRope(),
}


def apply_triton_kernels(model: nn.Module) -> TransformReport:
    """Swap the model's norms, activations and ropes for their Triton forms, in place.

    Meant for a CUDA model; on CPU tensors the kernels run only under ``TRITON_INTERPRET=1``
    (the tests). What was swapped is logged and returned.
    """
    swapped: Counter[str] = Counter()
    for name in [name for name, _ in model.named_modules() if name]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        make = _SWAPS.get(type(module))
        if make is None:
            continue
        swapped[type(module).__name__] += 1
        setattr(parent, child, make(module))
    report = TransformReport(swapped=dict(swapped))
    log.info("Triton kernels applied: %s", report)
    return report
