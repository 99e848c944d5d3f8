"""CPU backend with a compiled paged decode kernel; prefill as in the torch reference.

Decode attention is where a batched CPU step spends most of its time when K/V are first
gathered out of the pool: the copy reads and writes every cached byte once more, and SDPA's
one-query path then reads it at ~4 GB/s. ``torch.ops.tailserve.paged_decode_attention`` reads
each sequence's K/V rows in place through its block table, the query heads of a GQA group
sharing each row, with dynamic work hand-out across threads (contexts differ by 10x within a
step). Measured 3.2x faster than gather + SDPA for 32 sequences of 600-1000 tokens
(benchmarks/RESULTS.md, "CPU kernels").

Prefill chunks keep the reference path: they are matmul-shaped, which SDPA already does well.
"""

from __future__ import annotations

import torch

from tailserve.model.attention.base import AttentionMetadata
from tailserve.model.attention.torch_ref import TorchAttentionBackend


class CpuKernelAttentionBackend(TorchAttentionBackend):
    def begin_step(self, meta: AttentionMetadata) -> None:
        # The decode plan of the reference backend (padded groups) is not needed here.
        self._groups = []

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        k_cache = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
        v_cache = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = meta.num_decodes
        if n:
            # Decode tokens are the first n rows, one per sequence, in block_tables' order.
            torch.ops.tailserve.paged_decode_attention(
                out[:n], q[:n], kv_cache, meta.block_tables, meta.seq_lens, meta.scale
            )
        for i in range(n, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], kv_cache, meta, i
            )
        return out
