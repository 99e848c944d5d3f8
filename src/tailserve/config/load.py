"""How the checkpoint is read: ``--gguf-weights`` and ``--quantization`` resolved against the
runner that will serve them, before the model is loaded (``LoadConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tailserve.errors import ConfigError, ModelLoadError

# --quantization's blocks: Q8_0 / Q4_1 hold 32 values each; a group is a whole number of them.
RTN_BLOCK = 32
QUANTIZATIONS = ("int8", "int4")  # EngineArgs.quantization's choices


def check_quantization_group_size(group_size: int) -> None:
    """A group of ``--quantization-group-size`` values shares one scale (and minimum): a
    multiple of the 32-value blocks the kernels read, or -1 for one group per row."""
    if group_size != -1 and (group_size < RTN_BLOCK or group_size % RTN_BLOCK):
        raise ConfigError(
            f"quantization_group_size must be a positive multiple of {RTN_BLOCK} (the blocks "
            f"the kernels read) or -1 (one group per row), got {group_size}")


GGUF_WEIGHTS = ("auto", "packed", "dequantize")  # EngineArgs.gguf_weights's choices


def packed_weights_supported(device: str, dtype: str, cpu_kernels: bool) -> bool:
    """Whether a runner on ``device`` / ``dtype`` can serve packed blocks (a GGUF's, or
    ``--quantization``'s): float32 on CPU with the compiled kernels, the only ones that read
    them (``cpu_kernels``: ``Platform.cpu_kernels``)."""
    return device == "cpu" and dtype == "float32" and cpu_kernels


def _runs_on(device: str, dtype: str, cpu_kernels: bool) -> str:
    return f"this engine runs {dtype} on {device}" + (
        " without the kernels" if device == "cpu" and dtype == "float32" and not cpu_kernels
        else "")


def resolve_gguf_weights(choice: str, device: str, dtype: str, cpu_kernels: bool,
                         tensor_parallel_size: int = 1) -> Literal["packed", "dequantize"]:
    """``--gguf-weights`` to what the loader does: ``auto`` is packed where it can be served
    (faster and ~5x less memory on the bundled model, benchmarks/notes/weights.md), else
    dequantized; under tensor parallelism ``auto`` dequantizes, since a split of packed
    blocks must fall on block boundaries (model/transforms/tensor_parallel.py), which only the
    checkpoint's formats decide (``packed`` asks for it and fails with the numbers where a
    rank's share is not whole blocks). ``packed`` where it cannot be served is a
    ``ModelLoadError``."""
    if choice not in GGUF_WEIGHTS:
        raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}, got {choice!r}")
    supported = packed_weights_supported(device, dtype, cpu_kernels)
    if choice == "packed" and not supported:
        raise ModelLoadError(
            "gguf_weights='packed' needs the compiled CPU kernels on a float32 CPU runner; "
            + _runs_on(device, dtype, cpu_kernels))
    if choice == "auto":
        return "packed" if supported and tensor_parallel_size == 1 else "dequantize"
    return "packed" if choice == "packed" else "dequantize"


def check_quantization_supported(quantization: str | None, device: str, dtype: str,
                                 cpu_kernels: bool) -> None:
    """``--quantization`` stores blocks only the packed kernels read: a float32 CPU runner
    with the compiled kernels (``dtype`` auto resolves to float32 with it)."""
    if quantization is not None and not packed_weights_supported(device, dtype, cpu_kernels):
        raise ModelLoadError(
            f"--quantization {quantization} needs the compiled CPU kernels on a float32 CPU "
            "runner (they read its blocks); " + _runs_on(device, dtype, cpu_kernels))


@dataclass(frozen=True)
class LoadConfig:
    """How the checkpoint is read (``EngineArgs.resolve_load``): ``gguf_weights`` resolved
    from ``auto``, ``quantization`` checked against the runner that will serve it."""

    model: str | None
    gguf_weights: Literal["packed", "dequantize"]
    quantization: Literal["int8", "int4"] | None
    quantization_group_size: int
