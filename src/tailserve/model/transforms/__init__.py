"""Model transforms: swap a built model's modules for faster or distributed forms.

The model files (``llama.py``, ``layers.py``) are plain torch with no device switches; a
transform walks the module tree and replaces modules by type, the way gpt-fast applies
quantization and tensor parallelism. Each swapped module computes what the one it replaced
computed. ``apply_cpu_kernels`` is the first; quantization, tensor parallelism and GPU kernels
plug in beside it.
"""

from tailserve.model.transforms.cpu_kernels import (
    FusedApplyRope,
    FusedRMSNorm,
    FusedSiluAndMul,
    apply_cpu_kernels,
)
from tailserve.model.transforms.kernel_linear import KernelLinear
from tailserve.model.transforms.linear16 import Linear16, WideEmbedding
from tailserve.model.transforms.report import TransformReport

__all__ = [
    "FusedApplyRope",
    "FusedRMSNorm",
    "FusedSiluAndMul",
    "KernelLinear",
    "Linear16",
    "TransformReport",
    "WideEmbedding",
    "apply_cpu_kernels",
]
