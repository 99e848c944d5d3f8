"""CPU backend on the compiled kernels: the KV write, paged decode and paged prefill attention.

Decode attention is where a batched CPU step spends most of its time when K/V are first
gathered out of the pool: the copy reads and writes every cached byte once more, and SDPA's
one-query path then reads it at ~4 GB/s. ``torch.ops.tailserve.paged_decode_attention`` reads
each sequence's K/V rows in place through its block table, the query heads of a GQA group
sharing each row, with dynamic work hand-out across threads (contexts differ by 10x within a
step). Measured 3.2x faster than gather + SDPA for 32 sequences of 600-1000 tokens
(benchmarks/notes/cpu_kernels.md, "CPU kernels").

Prefill chunks go to ``paged_prefill_attention`` (causal, over the paged K/V in place, no
gather, no mask tensor) and the KV write to ``write_kv_cache``: both run on the kernels' work
pool like the products around them, where SDPA and ``index_copy_`` ran on OpenMP's threads and
the two pools spun against each other on a small host (benchmarks/notes/cpu_kernels.md,
"Prefill on one pool").
Queries in another dtype than float32, a head_dim the kernel does not tile (not a multiple
of 16), and a sliding-window layer in a step where some context is longer than its window (the
kernels attend to every cached position) keep the reference path.
"""

from __future__ import annotations

import torch

from tailserve.model.attention.base import AttentionMetadata
from tailserve.model.attention.torch_ref import TorchAttentionBackend


class CpuKernelAttentionBackend(TorchAttentionBackend):
    def begin_step(self, meta: AttentionMetadata) -> None:
        # The decode plan of the reference backend (padded groups) is not needed here: a
        # step that falls back to it is planned there when it does.
        self._plans = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if q.dtype != torch.float32 or q.shape[-1] % 16 or meta.window_binds(sliding_window):
            return super().forward(q, k, v, kv_cache, meta, sliding_window)
        torch.ops.tailserve.write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            self._decode_all(out, q, kv_cache, meta)
        if meta.num_decodes < meta.num_seqs:
            starts = meta.query_start_loc_tensor
            if starts is None:
                starts = torch.tensor(meta.query_start_loc, dtype=torch.int64)
            torch.ops.tailserve.paged_prefill_attention(
                out, q, kv_cache, meta.block_tables, meta.seq_lens, starts, meta.num_decodes,
                meta.scale,
            )
        return out

    def _decode_all(
        self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        # Decode tokens are the first n rows, one per sequence, in block_tables' order.
        n = meta.num_decodes
        torch.ops.tailserve.paged_decode_attention(
            out[:n], q[:n], kv_cache, meta.block_tables, meta.seq_lens, meta.scale
        )
