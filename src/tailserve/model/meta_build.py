"""``skip_init``: build modules on the meta device without running their initializers.

The runner builds the model on ``torch.device("meta")`` and gives it real tensors only when
the checkpoint is copied in, so ``nn.Linear`` / ``nn.Embedding``'s random initialization is
work thrown away -- and on meta tensors it is not free: ``normal_`` / ``uniform_`` on a meta
tensor run torch's Python reference implementations, whose first use imports
``torch._dynamo``, sympy and Triton (measured: +154 MB of RSS in every engine process, for
values nobody reads; benchmarks/resident_memory.py). Inside ``skip_init`` every
``torch.nn.init`` function returns its tensor untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class skip_init(TorchFunctionMode):  # a context manager, named like torch.no_grad
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs["tensor"]
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


__all__ = ["skip_init"]
