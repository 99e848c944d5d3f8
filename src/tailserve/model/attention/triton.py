"""The Triton backend (CUDA): KV write, paged decode and paged prefill in Triton kernels.

Each layer is at most three launches: the KV write, one decode launch over every decoding
sequence (plus a merge when the contexts are long enough to split, see
``triton_kernels.attention``), and one prefill launch over every prefill chunk, with its
cached context read through the block table. Nothing is gathered out of the pool, and no
tensor shape depends on the context lengths, so a decode step replays as a CUDA graph.

The tests run it on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``) against
``TorchAttentionBackend``.
"""

from __future__ import annotations

import torch

from tailserve.model.attention.base import AttentionBackend, AttentionMetadata
from tailserve.model.triton_kernels.attention import (
    choose_num_splits,
    paged_decode,
    paged_prefill,
    write_kv,
)


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graphs = True

    def __init__(self) -> None:
        # Set while capturing / replaying a CUDA graph: the split count then follows this
        # length (max_model_len), not the step's, so every replay matches the capture.
        self.graph_max_seq_len: int | None = None
        self._max_decode_len = 0
        self._max_query_len = 0
        self._num_splits: int | None = None
        self._query_start_loc: torch.Tensor | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        n = meta.num_decodes
        self._max_decode_len = max(meta.seq_lens_list[:n], default=0)
        self._max_query_len = max(meta.query_lens[n:], default=0)
        self._num_splits = None  # needs the KV head count: chosen in the first layer
        self._query_start_loc = meta.query_start_loc_tensor
        if self._query_start_loc is None and meta.num_seqs > n:
            self._query_start_loc = torch.tensor(
                meta.query_start_loc, dtype=torch.int64, device=meta.seq_lens.device
            )

    def set_graph_max_seq_len(self, max_seq_len: int | None) -> None:
        self.graph_max_seq_len = max_seq_len

    def num_splits(self, num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
        if self._num_splits is None:
            length = self.graph_max_seq_len or self._max_decode_len
            self._num_splits = choose_num_splits(num_decodes, num_kv_heads, length, str(device))
        return self._num_splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if meta.window_binds(sliding_window):
            # config.resolve_max_model_len caps max_model_len at the window on CUDA.
            raise NotImplementedError("sliding-window attention past the window is not served "
                                      "by the Triton kernels")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = meta.num_decodes
        if n:
            splits = self.num_splits(n, kv_cache.shape[3], q.device)
            paged_decode(out[:n], q[:n], kv_cache, meta.block_tables, meta.seq_lens,
                         meta.scale, splits)
        if meta.num_seqs > n:
            if self._query_start_loc is None:
                raise RuntimeError("begin_step was not called for this step")
            paged_prefill(out, q, kv_cache, meta.block_tables, meta.seq_lens,
                          self._query_start_loc, n, meta.num_seqs - n, self._max_query_len,
                          meta.scale)
        return out
