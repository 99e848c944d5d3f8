"""Persistent per-step input tensors: allocated once at start-up, filled in place every step.

A step's inputs (token ids, positions, slot mapping, block tables, sequence lengths, query
offsets, the rows whose logits are sampled) are bounded by ``max_num_batched_tokens`` and
``max_num_seqs``; each has one device tensor of that bound, and a step uses a prefix of it. So
the step loop never asks the allocator for them, and a CUDA graph captured over these tensors
reads each step's values at the same addresses.

On CUDA every device tensor has a pinned host twin. A step writes its values into the host
twin (numpy views: no torch op per value) and copies the used prefixes with ``non_blocking``
on a side stream; the compute stream waits for that copy's event, and the copy waits for the
event the compute stream records once the previous step's forward has read the buffers (so a
copy never overwrites inputs still in use, while everything else of the step — sampling
included — may still run). Before the host twin is written again, the previous copy's event
is waited on: a pinned buffer must not change under an in-flight DMA. (The engine is
synchronous today: a step is scheduled after the previous one's sampled ids reached the host,
so the window in which a copy could overlap the previous step's sampling is not yet used; an
asynchronous scheduler would get it from this ordering without changes here.)

On CPU the "device" tensor is the host tensor: the same fill, no copy.

``SamplingBuffers`` does the same for the sampler's per-row parameter vectors.

Padding for a captured decode batch (``pad_decodes``): token 0 at position 0, a slot one past
the pool (the Triton KV write skips it) and length 0 (the decode kernel writes zeros), so a
padding row neither reads nor writes the KV pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch


@dataclass(frozen=True)
class StepInputs:
    """Device views of one step's prefix of the buffers."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_seqs] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    block_tables: torch.Tensor  # [num_seqs, width] int64 (row stride: max_blocks_per_seq)
    logits_indices: torch.Tensor  # [num_sampled] int64


class _Twin:
    """A device tensor and the host tensor a step fills (the same tensor on CPU)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.device = torch.zeros(shape, dtype=torch.long, device=device)
        if device.type == "cuda":
            self.host = torch.zeros(shape, dtype=torch.long, pin_memory=True)
        else:
            self.host = self.device
        self.np: np.ndarray = self.host.numpy()


class StepInputBuffers:
    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
        num_slots: int, device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_slots = num_slots  # the padding slot: one past the KV pool
        self.device = device
        self._input_ids = _Twin((max_num_tokens,), device)
        self._positions = _Twin((max_num_tokens,), device)
        self._slots = _Twin((max_num_tokens,), device)
        self._seq_lens = _Twin((max_num_seqs,), device)
        self._qsl = _Twin((max_num_seqs + 1,), device)
        self._tables = _Twin((max_num_seqs, max_blocks_per_seq), device)
        self._logits = _Twin((max_num_seqs,), device)
        self._twins = (self._input_ids, self._positions, self._slots, self._seq_lens, self._qsl,
                       self._tables, self._logits)
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._copied = torch.cuda.Event()  # the last H2D copy is done
            self._consumed = torch.cuda.Event()  # the last forward has read the buffers
        self._num_tokens = 0
        self._num_seqs = 0
        self._num_sampled = 0
        self._width = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held (the host twins take as much pinned host memory on CUDA)."""
        return sum(t.device.numel() * t.device.element_size() for t in self._twins)

    # ------------------------------------------------------------------ fill (host side)
    def fill(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slot_mapping: Sequence[int],
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        logits_indices: Sequence[int],
    ) -> None:
        """Write one step's values into the host buffers (checked against their bounds)."""
        n, s = len(input_ids), len(seq_lens)
        width = max((len(t) for t in block_tables), default=0)
        if n > self.max_num_tokens or s > self.max_num_seqs or width > self.max_blocks_per_seq:
            raise ValueError(
                f"step of {n} tokens, {s} sequences, {width} blocks per sequence exceeds the "
                f"buffers ({self.max_num_tokens}, {self.max_num_seqs}, "
                f"{self.max_blocks_per_seq})"
            )
        if self.is_cuda:
            self._copied.synchronize()  # the previous copy has left the pinned buffers
        self._input_ids.np[:n] = input_ids
        self._positions.np[:n] = positions
        self._slots.np[:n] = slot_mapping
        self._qsl.np[: s + 1] = query_start_loc
        self._seq_lens.np[:s] = seq_lens
        tables = self._tables.np
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
            tables[i, len(table) : width] = 0  # the padding every backend may read
        self._logits.np[: len(logits_indices)] = logits_indices
        self._num_tokens, self._num_seqs, self._width = n, s, width
        self._num_sampled = len(logits_indices)

    def pad_decodes(self, batch_size: int) -> None:
        """Extend a decode-only step (one token per sequence) to ``batch_size`` rows of
        padding that touch no KV slot (module docstring); block tables take full width."""
        n = self._num_seqs
        if self._num_tokens != n or batch_size > self.max_num_seqs or batch_size < n:
            raise ValueError(f"cannot pad a step of {self._num_tokens} tokens in {n} sequences "
                             f"to a decode batch of {batch_size}")
        self._input_ids.np[n:batch_size] = 0
        self._positions.np[n:batch_size] = 0
        self._slots.np[n:batch_size] = self.num_slots
        self._seq_lens.np[n:batch_size] = 0
        last = self._qsl.np[n]
        self._qsl.np[n + 1 : batch_size + 1] = np.arange(last + 1, last + 1 + batch_size - n)
        self._num_tokens = self._num_seqs = batch_size
        self._width = self.max_blocks_per_seq

    # ------------------------------------------------------------------ copy (device side)
    def copy_to_device(self) -> StepInputs:
        """Issue the copies of the filled prefixes and return device views of them."""
        n, s, w, m = self._num_tokens, self._num_seqs, self._width, self._num_sampled
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self._consumed)
                for twin, rows in ((self._input_ids, n), (self._positions, n),
                                   (self._slots, n), (self._seq_lens, s), (self._qsl, s + 1),
                                   (self._tables, s), (self._logits, m)):
                    twin.device[:rows].copy_(twin.host[:rows], non_blocking=True)
                self._copied.record(self.copy_stream)
            compute.wait_event(self._copied)
        return StepInputs(
            input_ids=self._input_ids.device[:n],
            positions=self._positions.device[:n],
            slot_mapping=self._slots.device[:n],
            seq_lens=self._seq_lens.device[:s],
            query_start_loc=self._qsl.device[: s + 1],
            block_tables=self._tables.device[:s, :w],
            logits_indices=self._logits.device[:m],
        )

    def mark_consumed(self) -> None:
        """After the forward is enqueued: the next copy waits for it (CUDA)."""
        if self.is_cuda:
            self._consumed.record(torch.cuda.current_stream(self.device))


# The sampler's per-row vectors kept in SamplingBuffers, by name.
SAMPLING_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "temperature": torch.float32, "log_min_p": torch.float32, "top_p_bound": torch.float32,
    "top_k": torch.long, "top_k_on": torch.bool, "top_p_on": torch.bool,
    "greedy_index": torch.long, "random_index": torch.long,
})


class SamplingBuffers:
    """The sampler's per-row parameter vectors (temperature, top-k, ...) in persistent
    tensors of ``max_num_seqs`` rows, one per name, so a step's sampling allocates none and
    copies from pinned memory without blocking (CUDA).

    ``put(name, values)`` writes the host twin and returns the device prefix. On CUDA the copy
    is issued on the current stream (the sampler's own), and an event per name guards the
    pinned host row: a second ``put`` of the same name waits until the previous copy has left
    it. On CPU the tensor is written in place.
    """

    DTYPES = SAMPLING_DTYPES

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._device: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._np: dict[str, np.ndarray] = {}
        self._copied: dict[str, torch.cuda.Event] = {}
        for name, dtype in self.DTYPES.items():
            dev = torch.zeros(max_rows, dtype=dtype, device=device)
            host = torch.zeros(max_rows, dtype=dtype, pin_memory=True) if self.is_cuda else dev
            self._device[name], self._host[name] = dev, host
            self._np[name] = host.numpy()
            if self.is_cuda:
                self._copied[name] = torch.cuda.Event()

    def put(self, name: str, values: Sequence[float] | Sequence[int] | Sequence[bool]
            ) -> torch.Tensor:
        n = len(values)
        if n > self.max_rows:
            raise ValueError(f"{n} sampling rows exceed the buffers' {self.max_rows}")
        if self.is_cuda:
            self._copied[name].synchronize()
        self._np[name][:n] = values
        dev = self._device[name][:n]
        if self.is_cuda:
            dev.copy_(self._host[name][:n], non_blocking=True)
            self._copied[name].record()
        return dev
