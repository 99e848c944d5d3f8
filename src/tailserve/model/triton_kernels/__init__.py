"""Triton kernels for the CUDA path: paged attention (``attention``) and the model's small
fused ops (``elementwise``).

Import this package only where the kernels will run: ``@triton.jit`` decides at definition
time whether a kernel is compiled for the GPU or run by Triton's interpreter
(``TRITON_INTERPRET=1``, how the tests run them on CPU tensors). ``triton_available`` answers
without importing triton.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Triton is installed (the ``gpu`` extra); says nothing about a device."""
    return importlib.util.find_spec("triton") is not None
