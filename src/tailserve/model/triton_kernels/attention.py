"""Triton paged attention: KV write, decode over the block table (split over long contexts),
prefill and chunked prefill against cached context. GQA everywhere.

The paged cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence's token ``p`` lives in block ``block_tables[seq, p // block_size]`` at offset
``p % block_size``. Every kernel gathers K/V rows in place through that table, a tile of
``BLOCK_N`` key positions at a time (a tile may cross blocks: the block id is looked up per
position), so nothing is copied out of the pool and a tile's width does not depend on the
block size.

Decode (one query token per sequence): one program per (sequence, KV head, split). The query
heads of a GQA group are the rows of one ``tl.dot`` (padded to 16, the MMA minimum), so each
K/V row is read once per group. A long context is split into ``num_splits`` ranges of tiles
attended in parallel (flash-decoding); each writes an unnormalized partial output with its
running max and sum, and ``_reduce_splits_kernel`` merges them. The split ranges are computed
from ``seq_lens`` on the device, so one launch shape serves any lengths (a CUDA graph replays
it). Positions at or past ``seq_lens`` are never loaded: stale slots of a reused block, and
the zero-padding of a block table, cannot leak in.

Prefill (a chunk of ``query_len`` tokens at positions ``seq_len - query_len .. seq_len - 1``):
one program per (sequence, query head, tile of ``BLOCK_M`` queries). This step's K/V are
already in the pool (written first), so cached context and the chunk itself are read the same
way, with the causal mask on positions.

Numerics: scores, softmax and accumulators are float32. On a GPU the two products take the
cache's dtype (bf16/fp16 tensor cores; float32 as IEEE, not TF32, so float32 matches the
reference). Under ``TRITON_INTERPRET=1`` every load is widened to float32 first: the
interpreter's bf16 arithmetic is not IEEE bf16 (it computes on the raw bits).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tailserve import envs

# Partial results of a split decode: at most this many ranges per sequence.
MAX_NUM_SPLITS = 16
# A split should have at least this many key tiles, or its merge costs more than it saves.
MIN_TILES_PER_SPLIT = 4
DECODE_BLOCK_N = 32  # key positions per decode tile
PREFILL_BLOCK_M = 16  # query tokens per prefill program
PREFILL_BLOCK_N = 32  # key positions per prefill tile


def interpreting() -> bool:
    return envs.TRITON_INTERPRET.get()


def _dot_args(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The products' input dtype and precision for a cache of ``dtype`` (module docstring)."""
    if interpreting() or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(triton.next_power_of_2(n), at_least)


@functools.lru_cache(maxsize=8)
def _num_sms(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8  # the interpreter: any small number keeps the split logic exercised


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: str) -> int:
    """Splits per sequence for a decode of ``num_seqs`` sequences up to ``max_seq_len`` tokens.

    Enough programs to fill the device twice over, none with fewer than
    ``MIN_TILES_PER_SPLIT`` tiles, at most ``MAX_NUM_SPLITS``: a big batch gets one split
    (its sequences already fill the device), a lone long sequence gets many.
    """
    tiles = -(-max_seq_len // DECODE_BLOCK_N)
    by_length = max(1, tiles // MIN_TILES_PER_SPLIT)
    by_occupancy = max(1, -(-2 * _num_sms(device) // max(1, num_seqs * num_kv_heads)))
    return int(min(MAX_NUM_SPLITS, by_length, by_occupancy))


# ---------------------------------------------------------------------------------- KV write
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    # A slot past the pool is a padding token of a captured batch: it writes nothing.
    # (A vector compare: the interpreter cannot mask with a scalar condition.)
    live = (h * 0 + slot) < num_slots
    mask = (live & (h < NUM_KV_HEADS))[:, None] & (d[None, :] < HEAD_DIM)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; a slot >= num_blocks * block_size is skipped
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _, num_blocks, block_size = kv_cache.shape[:3]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous():
        raise ValueError("write_kv needs unit-stride head_dim and a contiguous cache")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_blocks * block_size,
        # Contiguous blocks: slot = block * block_size + offset has stride of one offset.
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=_pow2(head_dim),
    )


# ---------------------------------------------------------------------------------- decode
@triton.jit
def _paged_decode_kernel(
    out_ptr, part_out_ptr, part_ml_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    QUERY_GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * QUERY_GROUP + g
    d = tl.arange(0, DIM_PAD)
    gmask = g < QUERY_GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        pmask = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=pmask, other=0)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION
        )
        m_i = m_new

    hmask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        # A sequence of length 0 (padding of a captured batch) writes zeros.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask)
    else:
        # partials: out [num_seqs, NUM_HEADS, NUM_SPLITS, DIM_PAD], ml [.., NUM_SPLITS, 2]
        base = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + base[:, None] * DIM_PAD + d[None, :], acc, mask=hmask)
        tl.store(part_ml_ptr + base * 2, m_i, mask=gmask)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=gmask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    smask = s < NUM_SPLITS
    base = (seq * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + base * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + base * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(part_out_ptr + base[:, None] * DIM_PAD + d[None, :],
                  mask=smask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: length 0
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_decode(
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [>= num_seqs]; 0 for a padding row (it gets zeros)
    scale: float,
    num_splits: int,
) -> None:
    """One query token per sequence attends over its ``seq_lens[i]`` cached tokens."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    dim_pad = _pow2(head_dim, 16)
    dot_dtype, precision = _dot_args(kv_cache.dtype)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, dim_pad,
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2,
                              dtype=torch.float32, device=q.device)
    else:
        part_out = part_ml = out  # not read with one split
    cache = kv_cache[0]
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_ml, q, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0),
        QUERY_GROUP=group, GROUP_PAD=_pow2(group, 16), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        NUM_HEADS=num_heads, DOT_DTYPE=dot_dtype, PRECISION=precision,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_ml, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        )


# ---------------------------------------------------------------------------------- prefill
@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, first_seq, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    QUERY_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    h = tl.program_id(1)
    tile_m = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < query_len
    qpos = seq_len - query_len + rows  # each query's position; it sees keys 0 .. qpos
    d = tl.arange(0, DIM_PAD)
    dmask = d < HEAD_DIM
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=qmask, other=0.0).to(DOT_DTYPE)
    kvh = h // QUERY_GROUP
    # Keys past this tile's last query are never visible to it.
    kv_end = tl.minimum(seq_len, seq_len - query_len + (tile_m + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(0, tl.cdiv(kv_end, BLOCK_N)):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        pmask = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pmask, other=0)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        visible = pmask[None, :] & (pos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))  # key 0 is visible to every row: no -inf row
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION
        )
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask)


def paged_prefill(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] (the whole step's rows)
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # this step's K/V already written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] on the device
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    scale: float,
) -> None:
    """Causal attention of sequences ``first_seq .. first_seq + num_seqs - 1`` (their rows of
    ``q`` per ``query_start_loc``) over their cached context and themselves."""
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    dot_dtype, precision = _dot_args(kv_cache.dtype)
    cache = kv_cache[0]
    grid = (num_seqs, num_heads, math.ceil(max_query_len / PREFILL_BLOCK_M))
    _paged_prefill_kernel[grid](
        out, q, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start_loc, first_seq,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0),
        QUERY_GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=_pow2(head_dim, 16), BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N, DOT_DTYPE=dot_dtype, PRECISION=precision,
    )
