"""The torch reference backend: correct everywhere, fast enough on CPU.

Paged K/V are gathered into a workspace that is allocated once and reused by every layer and
every step (it only grows to a new high-water mark): a fresh multi-MB tensor per layer would
page-fault its way in each time, which on CPU cost 5x the copy itself (measured 54 ms vs
10 ms for 64 sequences x 60 blocks).

Decodes are sorted longest first by the runner and attended in groups of ``DECODE_GROUP``: each
group is padded only to its own longest context, then one SDPA call with a length mask covers
the group (GQA without repeating K/V). Prefill chunks run one SDPA per sequence; a chunk with no
earlier context attends to its own K/V with no gather at all. A sliding-window layer's masks also
hide the positions before its window (the blocks are gathered all the same: this is the
reference, not the fast path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tailserve.model.attention.base import AttentionBackend, AttentionMetadata

DECODE_GROUP = 16


@dataclass
class _Group:
    start: int  # index of the first sequence of the group
    end: int
    num_blocks: int  # blocks per sequence after padding
    block_index: torch.Tensor  # [(end - start) * num_blocks] block ids, padded with block 0
    mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size] bool
    # The same mask less the positions before a window, by window (made by the first
    # sliding layer of the step that needs it, reused by the others).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.window_masks:
            positions = torch.arange(self.mask.shape[-1], device=self.mask.device)
            # The query sits at seq_len - 1 and sees the window's positions seq_len - window ..
            first = seq_lens[self.start : self.end, None] - window
            self.window_masks[window] = self.mask & (positions[None, :] >= first)[:, None, None]
        return self.window_masks[window]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self) -> None:
        self._workspace = torch.empty(0)
        self._wide = torch.empty(0)  # a 16-bit cache's gathered K/V, widened (same reuse)
        # The decode groups planned this step, per metadata (one per KV cache group), by id
        # with the metadata itself so a recycled id is never taken for it.
        self._plans: dict[int, tuple[AttentionMetadata, list[_Group]]] = {}

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Plan the decode groups once per step; every layer reuses the plan."""
        self._plans = {}
        self._plan(meta)

    def _plan(self, meta: AttentionMetadata) -> list[_Group]:
        """The decode groups of ``meta`` (planned on first use in the step)."""
        entry = self._plans.get(id(meta))
        if entry is not None and entry[0] is meta:
            return entry[1]
        groups: list[_Group] = []
        self._plans[id(meta)] = (meta, groups)
        bs = meta.block_size
        for start in range(0, meta.num_decodes, DECODE_GROUP):
            end = min(start + DECODE_GROUP, meta.num_decodes)
            lens = meta.seq_lens_list[start:end]
            num_blocks = -(-max(lens) // bs)
            index = meta.block_tables[start:end, :num_blocks].reshape(-1)
            positions = torch.arange(num_blocks * bs, device=index.device)
            mask = positions[None, :] < meta.seq_lens[start:end, None]
            groups.append(_Group(start, end, num_blocks, index, mask[:, None, None, :]))
        return groups

    def _gather(
        self, kv_cache: torch.Tensor, block_index: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_index`` into the workspace: each [len(index) * block_size, H, D],
        in ``dtype`` (the queries'; a 16-bit cache is widened into a second workspace)."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        n = block_index.numel()
        need = 2 * n * block_size * num_kv_heads * head_dim
        ws = self._workspace
        if ws.numel() < need or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device:
            self._workspace = ws = torch.empty(need, dtype=kv_cache.dtype, device=kv_cache.device)
        buf = ws[:need].view(2, n, block_size, num_kv_heads, head_dim)
        torch.index_select(kv_cache[0], 0, block_index, out=buf[0])
        torch.index_select(kv_cache[1], 0, block_index, out=buf[1])
        if dtype != kv_cache.dtype:
            wide = self._wide
            if wide.numel() < need or wide.dtype != dtype or wide.device != kv_cache.device:
                self._wide = wide = torch.empty(need, dtype=dtype, device=kv_cache.device)
            buf = wide[:need].view(buf.shape).copy_(buf)
        flat = (n * block_size, num_kv_heads, head_dim)
        return buf[0].view(flat), buf[1].view(flat)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        # Planned by begin_step, or here for another KV cache group's metadata or for a step
        # a subclass that plans otherwise hands over.
        plan = self._plan(meta)
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        k_cache = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
        v_cache = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
        # A 16-bit cache under float32 activations: stored rounded to nearest even (the bits
        # the C++ decode step writes too), read back widened.
        k_cache.index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            for group in plan:  # the first num_decodes tokens, one per sequence
                out[group.start : group.end] = self._decode(q, kv_cache, meta, group,
                                                            sliding_window)
        for i in range(meta.num_decodes, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], kv_cache, meta, i, sliding_window
            )
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, group: _Group,
        window: int | None,
    ) -> torch.Tensor:
        n = group.end - group.start
        keys, values = self._gather(kv_cache, group.block_index, q.dtype)
        # [n * L, H_kv, D] -> [n, H_kv, L, D] as a strided view
        shape = (n, -1, keys.shape[1], keys.shape[2])
        out = F.scaled_dot_product_attention(
            q[group.start : group.end].unsqueeze(2),  # [n, H, 1, D]
            keys.view(shape).transpose(1, 2),
            values.view(shape).transpose(1, 2),
            attn_mask=group.window_mask(meta.seq_lens, window),
            scale=meta.scale,
            enable_gqa=True,
        )  # [n, H, 1, D]
        return out.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,  # [n, H, D]
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        window: int | None,
    ) -> torch.Tensor:
        n = q.shape[0]
        ctx = meta.seq_lens_list[i]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        mask: torch.Tensor | None = None
        if ctx == n:
            keys, values = k, v
        else:
            table = meta.block_tables[i, : -(-ctx // meta.block_size)]
            keys, values = self._gather(kv_cache, table, q.dtype)
            keys, values = keys[:ctx], values[:ctx]
        if ctx != n or (window is not None and window < ctx):
            # Query j sits at position ctx - n + j and sees keys 0 .. ctx - n + j, within a
            # window only the last ``window`` of them.
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            visible = kpos <= qpos
            if window is not None:
                visible &= kpos > qpos - window
            mask = visible[None, None]
        out = F.scaled_dot_product_attention(
            qh,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=meta.scale,
            enable_gqa=True,
        )  # [1, H, n, D]
        return out[0].transpose(0, 1)
