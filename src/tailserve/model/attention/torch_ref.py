"""The torch reference backend: correct everywhere, fast enough on CPU.

Decodes are batched: their blocks are gathered into one padded [B, L, H_kv, D] tensor and one
SDPA call attends with a length mask (GQA without repeating K/V). Prefill chunks run one
SDPA per sequence; a chunk with no earlier context skips the gather entirely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailserve.model.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
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

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], kv_cache,
                                           meta, i)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        nd = meta.num_decodes
        max_len = max(meta.seq_lens_list[:nd])
        max_blocks = -(-max_len // meta.block_size)
        table = meta.block_tables[:nd, :max_blocks]
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        # [nd, max_blocks * block_size, H_kv, D] -> [nd, H_kv, L, D] as a strided view
        keys = kv_cache[0][table].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1][table].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = (positions[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=meta.scale, enable_gqa=True
        )  # [nd, H, 1, D]
        return out.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,  # [n, H, D]
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
    ) -> torch.Tensor:
        n = q.shape[0]
        ctx = meta.seq_lens_list[i]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ctx == n:
            keys, values = k, v
            mask = None
        else:
            num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
            table = meta.block_tables[i, : -(-ctx // meta.block_size)]
            keys = kv_cache[0][table].view(-1, num_kv_heads, head_dim)[:ctx]
            values = kv_cache[1][table].view(-1, num_kv_heads, head_dim)[:ctx]
            # Query j sits at position ctx - n + j and sees keys 0 .. ctx - n + j.
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = (torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None])[None, None]
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
