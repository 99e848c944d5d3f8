"""The attention backend interface: paged K/V in, attention out; the model never branches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map onto sequences and KV blocks.

    Sequences are laid out decodes first (longest context first), then prefill chunks::

        tokens: [d0 d1 ... d_{D-1} | p0 p0 p0 ... | p1 p1 ... ]
                 one per decode      a chunk per prefilling sequence

    ``seq_lens`` are context lengths *after* this step (computed + new), so sequence i's new
    tokens sit at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``.
    """

    num_decodes: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: list[int]  # [num_seqs + 1] token offsets into the flattened batch
    query_lens: list[int]  # [num_seqs]
    seq_lens_list: list[int]  # [num_seqs]
    seq_lens: torch.Tensor  # [num_seqs] int64 on device
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0
    block_size: int
    scale: float
    # query_start_loc on the device, for kernels that read it there (Triton prefill); the
    # runner fills it from its persistent buffers on CUDA, else a backend builds it.
    query_start_loc_tensor: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def window_binds(self, sliding_window: int | None) -> bool:
        """Whether a layer with this window attends differently from a global one in this
        step: some sequence's context is longer than the window."""
        return sliding_window is not None and max(self.seq_lens_list, default=0) > sliding_window


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends over each sequence's blocks."""

    # A decode step through this backend can be captured as a CUDA graph: its launches'
    # shapes depend on the batch size only (see model/cuda_graphs.py).
    supports_cuda_graphs: bool = False

    def begin_step(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the forward: plan work every layer will reuse."""

    def set_graph_max_seq_len(self, max_seq_len: int | None) -> None:
        """While capturing (``max_seq_len`` set): plan for contexts up to it, not the step's."""
        raise NotImplementedError(f"{type(self).__name__} is not captured in CUDA graphs")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``sliding_window``: the calling layer's window (None: global). A token at position
        p then attends to positions p - sliding_window + 1 .. p only (transformers' mask);
        every position's K/V stays in the cache either way."""
