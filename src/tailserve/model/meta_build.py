"""The runner's meta build: the model built without memory, then given real tensors.

``skip_init``: build modules on the meta device without running their initializers.

The runner builds the model on ``torch.device("meta")`` and gives it real tensors only when
the checkpoint is copied in, so ``nn.Linear`` / ``nn.Embedding``'s random initialization is
work thrown away -- and on meta tensors it is not free: ``normal_`` / ``uniform_`` on a meta
tensor run torch's Python reference implementations, whose first use imports
``torch._dynamo``, sympy and Triton (measured: +154 MB of RSS in every engine process, for
values nobody reads; benchmarks/resident_memory.py). Inside ``skip_init`` every
``torch.nn.init`` function returns its tensor untouched.

``default_dtype``: modules built inside create their parameters in a given dtype (the
weights', so a 16-bit checkpoint is never widened on the way). ``materialize_model``: the
meta-built model's parameters as real, uninitialized tensors on the device, which
``load_weights`` then fills, and its rope table computed there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tailserve.model.llama import LlamaForCausalLM


class skip_init(TorchFunctionMode):  # a context manager, named like torch.no_grad
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs["tensor"]
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def materialize_model(model: LlamaForCausalLM, device: torch.device, max_model_len: int) -> None:
    """Give a meta-built model real (uninitialized) tensors wherever it still has meta ones:
    the parameters ``load_weights`` fills, and the rope tables computed again on ``device``."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in made:  # a tied parameter stays one parameter
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device=device),
                                                   requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
    with torch.device(device):
        model.build_rope(max_model_len)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:4]}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside create their parameters in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


__all__ = ["default_dtype", "materialize_model", "skip_init"]
