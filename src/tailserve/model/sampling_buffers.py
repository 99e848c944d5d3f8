"""The sampler's device tensors built from host values, in persistent buffers sized at
start-up: per-row parameters (temperature, top-k, ...; ``max_num_seqs`` rows), the index
vectors it gathers with (greedy / random / logprob rows, top-p retries) and the ragged
vectors of the penalties and the min_tokens mask (flattened ``row * vocab + token`` keys).

Without them every step built each of these with ``torch.tensor(list, device=...)``: on CUDA
a fresh allocation and a synchronous copy from pageable memory per vector. Here ``put(name,
values)`` writes a pinned host twin (numpy: no torch op) and copies the prefix with
``non_blocking`` on the current stream (the sampler's, so every kernel that reads it is
ordered after the copy), and returns the device prefix. An event per name guards the pinned
twin: a second ``put`` of the same name in a step (the top-p retry) waits until the previous
copy has left it. On CPU the twin is the tensor: written in place, nothing copied.

Capacity: the per-row and index names hold ``max_rows``; the penalty vectors hold
``ragged_capacity`` entries, which the runner sets to the bound of the penalties' distinct
(row, token) keys (``max_num_seqs x min(vocab, max_model_len)``), and the start-up memory
budget counts them (``sampling_buffer_bytes``). The min_tokens keys have no such bound (a
request lists any number of stop ids): they start at ``MIN_TOKENS_KEYS_PER_ROW`` a row, and a
step needing more grows that buffer once, to twice the need, logged — an allocation on a
step that sets a new maximum, never in the steady state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

log = logging.getLogger(__name__)

# Per-row vectors: at most max_rows entries.
ROW_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "temperature": torch.float32, "log_min_p": torch.float32, "top_p_bound": torch.float32,
    "top_k": torch.long, "top_k_on": torch.bool, "top_p_on": torch.bool,
    "greedy_index": torch.long, "random_index": torch.long, "logprob_index": torch.long,
    "pending_index": torch.long,
})
# Ragged vectors: keys (row * vocab + token) and their per-key factors.
RAGGED_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "min_tokens_keys": torch.long, "penalty_keys": torch.long,
    "penalty_repetition": torch.float32, "penalty_subtract": torch.float32,
})
SAMPLING_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({**ROW_DTYPES, **RAGGED_DTYPES})

Values = Sequence[float] | Sequence[int] | Sequence[bool] | np.ndarray
MIN_TOKENS_KEYS_PER_ROW = 16


def _capacities(max_rows: int, ragged_capacity: int) -> dict[str, int]:
    return {name: max_rows if name in ROW_DTYPES
            else MIN_TOKENS_KEYS_PER_ROW * max_rows if name == "min_tokens_keys"
            else ragged_capacity for name in SAMPLING_DTYPES}


def sampling_buffer_bytes(max_rows: int, ragged_capacity: int) -> int:
    """Device bytes ``SamplingBuffers(max_rows, ..., ragged_capacity)`` takes at start."""
    return sum(n * SAMPLING_DTYPES[name].itemsize
               for name, n in _capacities(max_rows, ragged_capacity).items())


class SamplingBuffers:
    DTYPES = SAMPLING_DTYPES

    def __init__(self, max_rows: int, device: torch.device,
                 ragged_capacity: int | None = None) -> None:
        self.max_rows = max_rows
        self.ragged_capacity = ragged_capacity if ragged_capacity is not None else 64 * max_rows
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._device: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._np: dict[str, np.ndarray] = {}
        self._copied: dict[str, torch.cuda.Event] = {}
        self.grown = 0  # buffers grown past their start-up size (a new maximum step)
        for name, size in _capacities(max_rows, self.ragged_capacity).items():
            self._allocate(name, size)

    def _allocate(self, name: str, size: int) -> None:
        dtype = self.DTYPES[name]
        dev = torch.zeros(size, dtype=dtype, device=self.device)
        host = torch.zeros(size, dtype=dtype, pin_memory=True) if self.is_cuda else dev
        self._device[name], self._host[name] = dev, host
        self._np[name] = host.numpy()
        if self.is_cuda:
            self._copied[name] = torch.cuda.Event()

    @property
    def nbytes(self) -> int:
        """Device bytes held (as much pinned host memory again on CUDA)."""
        return sum(t.numel() * t.element_size() for t in self._device.values())

    def capacity(self, name: str) -> int:
        return self._device[name].numel()

    def put(self, name: str, values: Values) -> torch.Tensor:
        n = len(values)
        if self.is_cuda:
            self._copied[name].synchronize()  # the last copy has left the pinned twin
        if n > self.capacity(name):
            if name in ROW_DTYPES:
                raise ValueError(f"{n} sampling rows exceed the buffers' {self.max_rows}")
            log.info("sampling buffer %s grown from %d to %d entries", name,
                     self.capacity(name), 2 * n)
            self._allocate(name, 2 * n)
            self.grown += 1
        self._np[name][:n] = values
        dev = self._device[name][:n]
        if self.is_cuda:
            dev.copy_(self._host[name][:n], non_blocking=True)
            self._copied[name].record()
        return dev


def row_tensor(
    name: str, values: Values, device: torch.device, buffers: SamplingBuffers | None
) -> torch.Tensor:
    """A vector of host values on the device: in the persistent buffers when the runner gave
    some (CUDA), else a new tensor."""
    if buffers is not None:
        return buffers.put(name, values)
    return torch.as_tensor(values, dtype=SamplingBuffers.DTYPES[name], device=device)
