"""Decode-only steps replayed as CUDA graphs: one graph per batch-size bucket, captured at
start-up, so a decode step is one launch instead of ~15 kernels per layer from Python.

A decode step of ``n`` sequences runs the graph of the smallest bucket ``>= n``; its rows past
``n`` are padding (``StepInputBuffers.pad_decodes``: no KV read or write). Steps with a prefill
chunk, or more decodes than the largest bucket, run the module forward. The graphs read the
runner's persistent ``StepInputBuffers`` (fixed addresses) and the KV pool, and write a static
hidden-state tensor; they share one memory pool, captured largest first so smaller graphs
reuse its blocks. The Triton decode launch inside a graph has its split count fixed by
``max_model_len`` (``TritonAttentionBackend.graph_max_seq_len``): its split ranges come from
the lengths on the device, so one capture serves every length.

``enforce_eager`` turns graphs off. On CPU ``CpuDecodeGraph`` (one compiled call) is the
counterpart behind the same runner seam; nothing here runs there, but the bucket choice and
the padding are plain functions the CPU tests cover.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from tailserve.model.attention import AttentionBackend, AttentionMetadata
from tailserve.model.step_buffers import StepInputBuffers, StepInputs

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (itself included):
    padding wastes at most 7 rows, and capture stays under ~40 graphs for 256 sequences."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences; None: beyond the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graph_batch_for(num_decodes: int, num_seqs: int, sizes: list[int] | None) -> int | None:
    """The captured batch size a step replays, or None for the module forward: no graphs
    (CPU, ``enforce_eager``, a backend that cannot be captured), a prefill chunk in the step,
    or more decodes than the largest bucket."""
    if sizes is None or num_seqs == 0 or num_decodes != num_seqs:
        return None
    return bucket_for(num_seqs, sizes)


def wants_cuda_graphs(device_type: str, enforce_eager: bool, backend: AttentionBackend) -> bool:
    return device_type == "cuda" and not enforce_eager and backend.supports_cuda_graphs


ForwardFn = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata],
                     torch.Tensor]


def decode_metadata(inputs: StepInputs, batch_size: int, block_size: int, scale: float,
                    max_model_len: int) -> AttentionMetadata:
    """Metadata of a padded decode batch over the buffers' device views. Its host lists are
    what the capture sees (replays never read them)."""
    return AttentionMetadata(
        num_decodes=batch_size,
        slot_mapping=inputs.slot_mapping,
        query_start_loc=list(range(batch_size + 1)),
        query_lens=[1] * batch_size,
        seq_lens_list=[max_model_len] * batch_size,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        block_size=block_size,
        scale=scale,
        query_start_loc_tensor=inputs.query_start_loc,
    )


class CudaDecodeGraphs:
    """The captured graphs of one runner; ``capture`` once after the KV pool exists."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [batch_size, hidden] static outputs
        self.pool_bytes = 0  # device memory the captures added (reserved bytes)

    def capture(
        self, forward: ForwardFn, buffers: StepInputBuffers, kv_caches: list[torch.Tensor],
        backend: AttentionBackend, block_size: int, scale: float, max_model_len: int,
    ) -> None:
        """Capture every bucket, largest first, on dummy decodes (all padding rows)."""
        device = buffers.device
        t0 = time.perf_counter()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        backend.set_graph_max_seq_len(max_model_len)
        try:
            for size in sorted(self.sizes, reverse=True):
                buffers.fill([], [], [], [0], [], [], [])
                buffers.pad_decodes(size)
                inputs = buffers.copy_to_device()
                meta = decode_metadata(inputs, size, block_size, scale, max_model_len)
                backend.begin_step(meta)
                # One eager run first: Triton compiles its kernels outside the capture.
                forward(inputs.input_ids, inputs.positions, kv_caches, meta)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = forward(inputs.input_ids, inputs.positions, kv_caches, meta)
                self.graphs[size] = graph
                self.outputs[size] = out
        finally:
            backend.set_graph_max_seq_len(None)
        torch.cuda.synchronize(device)
        self.pool_bytes = max(torch.cuda.memory_reserved(device) - before, 0)
        log.info("captured %d CUDA graphs (decode batches %d..%d) in %.1fs, %.1f MiB",
                 len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                 self.pool_bytes / (1 << 20))

    def replay(self, batch_size: int, num_seqs: int) -> torch.Tensor:
        """Replay the graph of ``batch_size`` over the buffers (filled, padded to it with
        ``pad_decodes`` and copied); the hidden states of the ``num_seqs`` real rows."""
        graph = self.graphs.get(batch_size)
        if graph is None:
            raise ValueError(f"no CUDA graph for a decode batch of {batch_size}")
        graph.replay()
        return self.outputs[batch_size][:num_seqs]
