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

    def _decode_all(
        self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        # Decode tokens are the first n rows, one per sequence, in block_tables' order.
        n = meta.num_decodes
        torch.ops.tailserve.paged_decode_attention(
            out[:n], q[:n], kv_cache, meta.block_tables, meta.seq_lens, meta.scale
        )
