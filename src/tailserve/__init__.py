"""tailserve: an LLM inference server built for steady tail latency under mixed traffic.

``LLM`` is imported lazily so that the torch-free parts (scheduler, block manager, bench,
analysis) can be imported without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tailserve import envs

# Before anything imports torch (the engine process imports this package first, too).
envs.apply_process_defaults()

from tailserve.config import EngineArgs  # noqa: E402
from tailserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tailserve.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from tailserve.engine.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tailserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tailserve' has no attribute {name!r}")
