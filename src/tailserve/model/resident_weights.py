"""The bytes a built model's weights hold in memory, counted from its tensors after every
transform: what ``tailserve:model_weight_bytes`` and the runner's start-up log report.

Counted, not predicted: a float32 checkpoint served as bfloat16 is its bfloat16 copies, a
packed GGUF its blocks (fused q/k/v concatenated once), and the CPU kernels' layout copies
(``KernelLinear``'s panel and oneDNN copies, ``Linear16``'s panels) are there because they
are resident. Every tensor of every module counts once, by its storage (a tied LM head is the
embedding table; views of one storage are that storage): parameters, buffers and the plain
tensor attributes the transforms keep. The rope table is not a weight and is left out.

Labels are storage formats as ``model/weight_storage.py`` names them (``Q4_1``, ``Q8_0``,
``bfloat16``, ``float32`` ...), so ``tailserve plan``'s prediction of the stored formats
compares with it format by format (tests/test_resident_weights.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

from tailserve.model.layers import RotaryEmbedding
from tailserve.model.quant.formats import format_of, is_packed


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the module itself holds (not its children's)."""
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (b for b in module._buffers.values() if b is not None)
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _key_and_bytes(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    if t.is_mkldnn:  # oneDNN's opaque reordered weight: no storage to share or to ask
        return ("opaque", id(t)), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return ("storage", storage.data_ptr()), storage.nbytes()


def storage_format(t: torch.Tensor) -> str:
    """A tensor's storage format: its block format's name, else its dtype's."""
    return format_of(t).name if is_packed(t) else str(t.dtype).removeprefix("torch.")


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes per storage format of every distinct tensor ``model`` holds, the rope table
    aside (module docstring)."""
    seen: set[tuple[str, int]] = set()
    out: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        for t in _tensors(module):
            if t.is_meta or t.numel() == 0:
                continue
            key, nbytes = _key_and_bytes(t)
            if key in seen:
                continue
            seen.add(key)
            out[storage_format(t)] += nbytes
    return dict(out)


__all__ = ["resident_weight_bytes", "storage_format"]
