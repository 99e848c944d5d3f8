"""The Triton kernels of the CUDA path, run on CPU tensors by Triton's interpreter, against the
torch reference: paged decode (split or not), prefill and chunked prefill over cached context,
the KV write, and the fused norm / rope / SiLU-and-mul. Shapes are tiny: the interpreter runs
each program in numpy.

Stale slots: the Triton side runs on a pool whose every slot outside the sequences' contexts
is NaN (and so is block 0, the block tables' padding), the reference on the same pool with
finite garbage there; a single stale read would turn an output row into NaN.
"""

from __future__ import annotations

import math
import os

# Before any kernel is defined: @triton.jit picks compiled or interpreted at definition time.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tailserve.model.attention import AttentionMetadata
from tailserve.model.attention.torch_ref import TorchAttentionBackend
from tailserve.model.attention.triton import TritonAttentionBackend
from tailserve.model.layers import ApplyRope, RMSNorm, SiluAndMul, apply_rope
from tailserve.model.triton_kernels import attention as tk
from tailserve.model.triton_kernels import elementwise as te


def _step(
    seqs: list[tuple[int, int]],  # (cached tokens before the step, tokens this step)
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           AttentionMetadata]:
    """(q, k, v, clean pool, poisoned pool, metadata) for one step over ``seqs``, decodes
    (one new token) first, as the runner lays them out."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # block 0 stays padding; 3 never used
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=g).to(dtype)
    poisoned = torch.full(shape, math.nan, dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # shuffled, never 0
    tables, slots, qsl, seq_lens = [], [], [0], []
    for (cached, new), nb in zip(seqs, blocks_per_seq, strict=True):
        table, ids = ids[:nb], ids[nb:]
        for p in range(cached):  # context from earlier steps, identical in both pools
            b, o = table[p // block_size], p % block_size
            poisoned[:, b, o] = pool[:, b, o]
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
        tables.append(table)
        qsl.append(qsl[-1] + new)
        seq_lens.append(cached + new)
    width = max(map(len, tables))
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        num_decodes=sum(1 for _, n in seqs if n == 1),
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        query_lens=[n for _, n in seqs],
        seq_lens_list=seq_lens,
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=block_size,
        scale=1.0 / math.sqrt(head_dim),
    )
    return q, k, v, pool, poisoned, meta


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
    ref = TorchAttentionBackend()
    ref.begin_step(meta)
    return ref.forward(q.float(), k.float(), v.float(), pool.float(), meta)


def _triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
    backend = TritonAttentionBackend()
    backend.begin_step(meta)
    return backend.forward(q, k, v, pool, meta)


# (num_heads, num_kv_heads, head_dim, block_size): MHA, GQA 2:1 / 4:1 / 8:1 (MQA)
SHAPES = [(2, 2, 64, 16), (4, 2, 128, 32), (4, 1, 64, 32), (8, 1, 128, 16)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES)
def test_mixed_step_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    # Decodes with ragged contexts (one at a block boundary, one a single token), then a
    # fresh prompt, a chunk over cached context and a chunk that starts mid-block.
    seqs = [(70, 1), (31, 1), (block_size, 1), (0, 1), (0, 19), (40, 17), (block_size + 5, 3)]
    q, k, v, pool, poisoned, meta = _step(seqs, num_heads, num_kv_heads, head_dim, block_size)
    expected = _reference(q, k, v, pool.clone(), meta)
    got = _triton(q, k, v, poisoned, meta)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    # The step's own K/V went to their slots.
    flat = poisoned.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v, atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])
def test_split_decode_equals_one_pass(num_splits: int) -> None:
    # 16 splits of a 9-tile context leave most splits empty; a length-0 row (a padding row of
    # a captured batch) gets zeros.
    seqs = [(280, 1), (95, 1), (33, 1)]
    q, k, v, pool, poisoned, meta = _step(seqs, 4, 2, 64, 16, seed=1)
    expected = _reference(q, k, v, pool.clone(), meta)
    tk.write_kv(k, v, poisoned, meta.slot_mapping)
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.long)])
    tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    qp = torch.cat([q, torch.randn(1, 4, 64)])
    out = torch.full_like(qp, 7.0)
    tk.paged_decode(out, qp, poisoned, tables, seq_lens, meta.scale, num_splits)
    torch.testing.assert_close(out[:3], expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[3], torch.zeros(4, 64))


def test_num_splits_follows_length_and_occupancy() -> None:
    # interpreter: 8 "SMs", so 16 programs fill it twice
    assert tk.choose_num_splits(1, 1, 16, "cpu") == 1  # one tile: nothing to split
    assert tk.choose_num_splits(1, 1, 32 * 4 * 5, "cpu") == 5  # by length
    assert tk.choose_num_splits(1, 1, 32 * 4 * 100, "cpu") == tk.MAX_NUM_SPLITS
    assert tk.choose_num_splits(16, 1, 32 * 4 * 100, "cpu") == 1  # batch fills the device
    assert tk.choose_num_splits(2, 2, 32 * 4 * 100, "cpu") == 4


def test_bfloat16_step_matches_reference_to_bf16_precision() -> None:
    seqs = [(45, 1), (0, 1), (20, 12)]
    q, k, v, pool, poisoned, meta = _step(seqs, 4, 2, 64, 16, dtype=torch.bfloat16, seed=2)
    expected = _reference(q, k, v, pool.clone(), meta)
    got = _triton(q, k, v, poisoned, meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_write_kv_skips_slots_past_the_pool() -> None:
    cache = torch.zeros(2, 2, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    v = torch.randn(3, 2, 64)
    tk.write_kv(k, v, cache, torch.tensor([5, 32, 17]))  # 32 = one past the pool: padding
    flat = cache.view(2, 32, 2, 64)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 17], v[2])
    assert int((flat.abs().sum((2, 3)) != 0).sum()) == 4  # slots 5 and 17, K and V


# ---------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual_add(dtype: torch.dtype) -> None:
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(dtype)
    x = torch.randn(5, 96).to(dtype)
    r = torch.randn(5, 96).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2,
                                                                       "rtol": 2e-2}
    with torch.no_grad():
        torch.testing.assert_close(te.rms_norm(x, norm.weight, norm.eps), norm(x), **tol)
        exp_out, exp_res = norm(x, r)
        x2, r2 = x.clone(), r.clone()
        te.fused_add_rms_norm(x2, r2, norm.weight, norm.eps)
    torch.testing.assert_close(r2, exp_res, **tol)
    torch.testing.assert_close(x2, exp_out, **tol)


def test_rope_in_place_on_a_strided_qkv_view() -> None:
    # q and k heads as a view of a fused qkv row, as LlamaAttention hands them over.
    num_tokens, heads, head_dim = 4, 6, 64
    qkv = torch.randn(num_tokens, (heads + 2) * head_dim)
    qk = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    cos = torch.randn(num_tokens, 1, head_dim // 2)
    sin = torch.randn(num_tokens, 1, head_dim // 2)
    expected = apply_rope(qk.clone(), cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    assert te.rope_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 2 * 1100)  # two column tiles, the second partial
    torch.testing.assert_close(te.silu_and_mul(x), SiluAndMul()(x), atol=1e-6, rtol=1e-5)


def test_apply_triton_kernels_swaps_and_keeps_the_forward() -> None:
    from torch import nn

    from tailserve.model.transforms.triton_kernels import (
        TritonApplyRope,
        TritonRMSNorm,
        TritonSiluAndMul,
        apply_triton_kernels,
    )

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(64, 1e-6)
            self.act = SiluAndMul()
            self.rope = ApplyRope()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            h = self.act(self.norm(x))  # [T, 32]
            return self.rope(h.view(-1, 1, 32), cos, sin).reshape(-1, 32)

    block = Block()
    x = torch.randn(3, 64)
    cos, sin = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    with torch.no_grad():
        expected = block(x, cos, sin)
        report = apply_triton_kernels(block)
        got = block(x, cos, sin)
    assert report.swapped == {"RMSNorm": 1, "SiluAndMul": 1, "ApplyRope": 1}
    assert isinstance(block.norm, TritonRMSNorm)
    assert isinstance(block.act, TritonSiluAndMul)
    assert isinstance(block.rope, TritonApplyRope)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_factory_picks_triton_for_cuda_and_never_for_cpu() -> None:
    from tailserve.model.attention import get_attention_backend
    from tailserve.model.attention.cpu_kernels import CpuKernelAttentionBackend

    assert type(get_attention_backend("cuda")) is TritonAttentionBackend
    assert type(get_attention_backend("cpu")) is TorchAttentionBackend
    assert type(get_attention_backend("cpu", cpu_kernels=True)) is CpuKernelAttentionBackend
    assert TritonAttentionBackend.supports_cuda_graphs
    assert not TorchAttentionBackend.supports_cuda_graphs
