"""Persistent per-step input tensors: allocated once at start-up, filled in place every step.

A step's inputs (token ids, positions, slot mapping, block tables, sequence lengths, query
offsets, the rows whose logits are sampled) are bounded by ``max_num_batched_tokens`` and
``max_num_seqs``; each has one device tensor of that bound, and a step uses a prefix of it. So
the step loop never asks the allocator for them, and a CUDA graph captured over these tensors
reads each step's values at the same addresses.

On CUDA each device tensor has two pinned host staging twins, used by alternate steps. A step
writes its values into its staging twin (numpy views: no torch op per value) and copies the
used prefixes with ``non_blocking`` on a side stream (``CudaCopyOrder``). The ordering
invariant, for step N filling staging slot k = N % 2:

1. the host writes slot k only once step N-2's copy, the last one to read it, has completed
   (the host waits on that copy's event; step N-1's copy, from the other slot, may still be
   in flight: the host fills step N while the DMA of step N-1 runs);
2. step N's copy into the device tensors waits for the event the compute stream recorded once
   step N-1's forward and logits gather, the last reads of the device tensors, were enqueued;
   step N-1's sampling does not read them, so the copy overlaps it;
3. step N's forward waits for step N's copy event.

So no DMA reads a staging twin while the host writes it (1), no copy overwrites inputs a
forward may still read (2), and no forward reads inputs before they land (3). (The engine is
synchronous today: step N is scheduled after step N-1's sampled ids reached the host, so the
window of (2) is not yet used by the engine loop; an asynchronous scheduler gets it without
changes here.)

On CPU the "device" tensor is the host tensor: the same fill, no copy and no order to keep
(``copy_order`` None). A test injects a fake ``CopyOrder`` on CPU to run the staged path —
separate staging twins, copies and the order of the event calls — without a GPU.

``SamplingBuffers`` (``sampling_buffers.py``) does the same for the sampler's tensors.

Padding for a captured decode batch (``pad_decodes``): token 0 at position 0, a slot one past
the pool (the Triton KV write skips it) and length 0 (the decode kernel writes zeros), so a
padding row neither reads nor writes the KV pool.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

NUM_STAGING_SLOTS = 2  # double-buffered: the host fills one while the other's copy runs


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


class CopyOrder(Protocol):
    """The events and streams of the invariant in the module docstring (one per buffers)."""

    def wait_staging_free(self, slot: int) -> None:
        """Block the host until the last copy out of staging ``slot`` has completed (1)."""

    def copying(self, slot: int) -> AbstractContextManager[None]:
        """Around the copies out of ``slot``: on the side stream, after the last forward's
        reads (2); on exit record the slot's copy event and make the compute stream wait (3)."""

    def mark_consumed(self) -> None:
        """On the compute stream, after the step's last read of the device tensors."""


def step_buffer_bytes(max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> int:
    """Device bytes ``StepInputBuffers`` of these bounds takes (all int64)."""
    return 8 * (3 * max_num_tokens + max_num_seqs * (3 + max_blocks_per_seq) + 1)


class CudaCopyOrder:
    """``CopyOrder`` on CUDA: a side stream for the copies and three events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        # One per staging slot: the last copy out of it is done.
        self._copied = [torch.cuda.Event() for _ in range(NUM_STAGING_SLOTS)]
        self._consumed = torch.cuda.Event()  # the last forward has read the device tensors

    def wait_staging_free(self, slot: int) -> None:
        self._copied[slot].synchronize()  # a no-op before the event's first record

    @contextmanager
    def copying(self, slot: int) -> Iterator[None]:
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._consumed)
            yield
            self._copied[slot].record(self.copy_stream)
        compute.wait_event(self._copied[slot])

    def mark_consumed(self) -> None:
        self._consumed.record(torch.cuda.current_stream(self.device))


class _Twin:
    """A device tensor and its staging tensors, one per slot (all the device tensor itself
    where there is no copy)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, staged: bool) -> None:
        self.device = torch.zeros(shape, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self.host = ([torch.zeros(shape, dtype=torch.long, pin_memory=pin)
                      for _ in range(NUM_STAGING_SLOTS)] if staged
                     else [self.device] * NUM_STAGING_SLOTS)
        self.np: list[np.ndarray] = [h.numpy() for h in self.host]


class StepInputBuffers:
    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
        num_slots: int, device: torch.device, copy_order: CopyOrder | None = None,
    ) -> None:
        """``copy_order``: None picks ``CudaCopyOrder`` on CUDA and no copies elsewhere; a
        test passes its own to run the staged path on CPU."""
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_slots = num_slots  # the padding slot: one past the KV pool
        self.device = device
        if copy_order is None and device.type == "cuda":
            copy_order = CudaCopyOrder(device)
        self.copy_order = copy_order
        staged = copy_order is not None
        self._input_ids = _Twin((max_num_tokens,), device, staged)
        self._positions = _Twin((max_num_tokens,), device, staged)
        self._slots = _Twin((max_num_tokens,), device, staged)
        self._seq_lens = _Twin((max_num_seqs,), device, staged)
        self._qsl = _Twin((max_num_seqs + 1,), device, staged)
        self._tables = _Twin((max_num_seqs, max_blocks_per_seq), device, staged)
        self._logits = _Twin((max_num_seqs,), device, staged)
        self._twins = (self._input_ids, self._positions, self._slots, self._seq_lens, self._qsl,
                       self._tables, self._logits)
        self.slot = NUM_STAGING_SLOTS - 1  # the staging slot of the last fill
        self._num_tokens = 0
        self._num_seqs = 0
        self._num_sampled = 0
        self._width = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held (the staging twins take twice as much pinned host memory on
        CUDA)."""
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
        """Write one step's values into the next staging slot (checked against the bounds)."""
        n, s = len(input_ids), len(seq_lens)
        width = max((len(t) for t in block_tables), default=0)
        if n > self.max_num_tokens or s > self.max_num_seqs or width > self.max_blocks_per_seq:
            raise ValueError(
                f"step of {n} tokens, {s} sequences, {width} blocks per sequence exceeds the "
                f"buffers ({self.max_num_tokens}, {self.max_num_seqs}, "
                f"{self.max_blocks_per_seq})"
            )
        k = self.slot = (self.slot + 1) % NUM_STAGING_SLOTS
        if self.copy_order is not None:
            self.copy_order.wait_staging_free(k)  # invariant (1)
        self._input_ids.np[k][:n] = input_ids
        self._positions.np[k][:n] = positions
        self._slots.np[k][:n] = slot_mapping
        self._qsl.np[k][: s + 1] = query_start_loc
        self._seq_lens.np[k][:s] = seq_lens
        tables = self._tables.np[k]
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
            tables[i, len(table) : width] = 0  # the padding every backend may read
        self._logits.np[k][: len(logits_indices)] = logits_indices
        self._num_tokens, self._num_seqs, self._width = n, s, width
        self._num_sampled = len(logits_indices)

    def pad_decodes(self, batch_size: int) -> None:
        """Extend a decode-only step (one token per sequence) to ``batch_size`` rows of
        padding that touch no KV slot (module docstring); block tables take full width."""
        n = self._num_seqs
        if self._num_tokens != n or batch_size > self.max_num_seqs or batch_size < n:
            raise ValueError(f"cannot pad a step of {self._num_tokens} tokens in {n} sequences "
                             f"to a decode batch of {batch_size}")
        k = self.slot
        self._input_ids.np[k][n:batch_size] = 0
        self._positions.np[k][n:batch_size] = 0
        self._slots.np[k][n:batch_size] = self.num_slots
        self._seq_lens.np[k][n:batch_size] = 0
        qsl = self._qsl.np[k]
        last = qsl[n]
        qsl[n + 1 : batch_size + 1] = np.arange(last + 1, last + 1 + batch_size - n)
        self._num_tokens = self._num_seqs = batch_size
        self._width = self.max_blocks_per_seq

    # ------------------------------------------------------------------ copy (device side)
    def copy_to_device(self) -> StepInputs:
        """Issue the copies of the filled prefixes and return device views of them."""
        n, s, w, m = self._num_tokens, self._num_seqs, self._width, self._num_sampled
        if self.copy_order is not None:
            k = self.slot
            with self.copy_order.copying(k):  # invariants (2) and (3)
                for twin, rows in ((self._input_ids, n), (self._positions, n),
                                   (self._slots, n), (self._seq_lens, s), (self._qsl, s + 1),
                                   (self._tables, s), (self._logits, m)):
                    twin.device[:rows].copy_(twin.host[k][:rows], non_blocking=True)
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
        """After the step's last read of the device tensors is enqueued (the forward and
        the logits gather, before sampling): the next copy may start (2)."""
        if self.copy_order is not None:
            self.copy_order.mark_consumed()
