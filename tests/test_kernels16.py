"""16-bit storage in the compiled CPU kernels: panel16_linear (bf16 / fp16 weights, float32
activations; widened and native bf16 paths) and paged attention over a 16-bit KV pool, each
against a float64 torch reference of what it stores."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tailserve.model.transforms.linear16 import (
    Linear16,
    WideEmbedding,
    panel16_rows,
    panel16_weight,
    share_tied_table,
)
from test_cpu_kernels import make_pool, reference_decode

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
ops = torch.ops.tailserve
HAS_BF16_DOT = torch.cpu._is_avx512_bf16_supported()


@pytest.fixture(params=["widen", "native"])
def bf16_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both bfloat16 paths where the CPU has AVX512-BF16 (set_bf16_dot(False) forces the
    widening one, as TAILSERVE_CPU_BF16_DOT=0 does); the native one is skipped elsewhere."""
    native = request.param == "native"
    if native and not HAS_BF16_DOT:
        pytest.skip("this CPU has no AVX512-BF16")
    assert ops.set_bf16_dot(native) is native
    yield request.param
    ops.set_bf16_dot(True)


def reference16(x: torch.Tensor, w16: torch.Tensor, b: torch.Tensor | None, native: bool
                ) -> torch.Tensor:
    """float64 product of what the kernel reads: the 16-bit weights, x (rounded to bfloat16
    on the native path, whose dot product takes bf16 operands)."""
    xr = x.bfloat16().double() if native else x.double()
    y = xr @ w16.double().T
    return y + b.double() if b is not None else y


SHAPES = [(1, 576, 960), (3, 37, 16), (5, 64, 48), (6, 1, 32), (9, 100, 32), (70, 577, 64)]


@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
@pytest.mark.parametrize("bias", [False, True])
def test_panel16_linear_bf16_matches_reference(bf16_path: str, m: int, k: int, n: int,
                                               bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    got = ops.panel16_linear(x, panel16_weight(w), b)
    ref = reference16(x, w, b, native=bf16_path == "native")
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 sums of k products of magnitude ~1: a few ulps of sqrt(k)-sized results.
    assert (got.double() - ref).abs().max().item() < 2e-5 * max(k, 16)


@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_panel16_linear_fp16_matches_reference(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m + k * 3 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).half()
    b = torch.randn(n, generator=g)
    got = ops.panel16_linear(x, panel16_weight(w), b)
    err = (got.double() - reference16(x, w, b, native=False)).abs().max().item()
    assert err < 2e-5 * max(k, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [576, 37, 1, 2, 3])
def test_panel16_linear_rows_do_not_depend_on_batch_mates(bf16_path: str, dtype: torch.dtype,
                                                          k: int) -> None:
    """(bias + first half) + second half at any M, as panel_linear: a sequence gets the same
    bits alone as in a batch (one row reads the halves as two streams, more rows in turn)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(13, k, generator=g)
    w = panel16_weight(torch.randn(32, k, generator=g).to(dtype))
    b = torch.randn(32, generator=g)
    batched = ops.panel16_linear(x, w, b)
    for i in range(13):
        assert torch.equal(ops.panel16_linear(x[i : i + 1], w, b)[0], batched[i])
    for m in (2, 6, 7, 9):
        assert torch.equal(ops.panel16_linear(x[:m], w, b), batched[:m])


def test_panel16_linear_rejects_bad_inputs() -> None:
    w = panel16_weight(torch.randn(32, 24).bfloat16())
    with pytest.raises(RuntimeError, match="K pairs = 12"):
        ops.panel16_linear(torch.randn(2, 26), w, None)
    with pytest.raises(RuntimeError, match="bad bias"):
        ops.panel16_linear(torch.randn(2, 24), w, torch.randn(31))
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.panel16_linear(torch.randn(2, 24).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        ops.panel16_linear(torch.randn(2, 24), torch.randn(2, 24, 16), None)
    assert ops.panel16_linear(torch.randn(0, 24), w, None).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear16_and_wide_embedding_keep_one_16bit_table(dtype: torch.dtype) -> None:
    """A tied head and embedding: after share_tied_table the rows come from the head's panels
    (the table itself is gone), bit for bit the widened table; 20 outputs pad to 32 columns."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(48, 37, generator=g).to(dtype)
    embed = nn.Embedding(48, 37, dtype=dtype)
    embed.weight.data = table.clone()
    head = nn.Linear(37, 48, bias=False, dtype=dtype)
    head.weight = embed.weight
    model = nn.Module()
    model.embed_tokens, model.lm_head = WideEmbedding(embed), Linear16(head, shared=True)
    ids = torch.tensor([0, 47, 16, 5, 5])
    assert torch.equal(model.embed_tokens(ids), table[ids].float())
    assert share_tied_table(model) == table.numel() * 2
    assert model.embed_tokens.weight is None and model.lm_head.weight is None
    assert torch.equal(model.embed_tokens(ids), table[ids].float())
    x = torch.randn(3, 37, generator=g)
    torch.testing.assert_close(model.lm_head(x), x @ table.float().T, rtol=2e-2, atol=2e-2)
    lin = nn.Linear(37, 20, bias=False, dtype=dtype)
    odd = Linear16(lin, shared=False)
    assert not odd.exact_panels
    assert torch.equal(panel16_rows(odd.panel, torch.arange(20), 37), lin.weight.float())
    y = odd(x)
    assert y.shape == (3, 20) and y.is_contiguous()
    torch.testing.assert_close(y, x @ lin.weight.float().T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,lens",
    [(9, 3, 64, [1, 7, 8, 9, 16, 17, 300, 33]), (8, 1, 128, [301, 2]), (4, 2, 32, [5, 40])],
    ids=["gqa3-d64-many", "mqa-d128-few", "generic-d32"],
)
def test_paged_decode_attention_reads_a_16bit_pool(
    kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, lens: list[int]
) -> None:
    """float32 q over a bf16 / fp16 pool: the same answer as float64 attention over that
    pool's values (widening is exact), to float32 rounding; the AVX2 paths (d64, d128) and
    the generic one (d32)."""
    q, kv32, tables = make_pool(lens, heads, kv_heads, head_dim, torch.float32, seed=heads)
    kv = kv32.to(kv_dtype)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full(q.shape, float("nan"))
    ops.paged_decode_attention(out, q, kv, tables, torch.tensor(lens), scale)
    ref = reference_decode(q, kv.float(), tables, lens, scale)
    assert (out.double() - ref).abs().max().item() < 1e-5
    # what the 16-bit pool costs against the float32 one it was rounded from
    full = reference_decode(q, kv32, tables, lens, scale)
    assert (out.double() - full).abs().max().item() < (2e-2 if kv_dtype == torch.bfloat16
                                                       else 3e-3)


def test_paged_decode_attention_rejects_mixed_16bit_q() -> None:
    q, kv, tables = make_pool([5], 4, 2, 64, torch.float16, seed=1)
    with pytest.raises(RuntimeError, match="want the same dtype, or float32 q"):
        ops.paged_decode_attention(torch.empty(q.shape, dtype=torch.float16), q,
                                   kv.bfloat16(), tables, torch.tensor([5]), 0.125)


def test_f_linear_reference_is_what_linear16_computes() -> None:
    """The module form against F.linear on the widened weights (the model's reference)."""
    g = torch.Generator().manual_seed(9)
    lin = nn.Linear(64, 48, dtype=torch.bfloat16)
    lin.bias.data = torch.randn(48, generator=g)  # biases stay float32 (compute dtype)
    x = torch.randn(4, 64, generator=g)
    ops.set_bf16_dot(False)
    try:
        got = Linear16(lin, shared=False)(x)
    finally:
        ops.set_bf16_dot(True)
    torch.testing.assert_close(got, F.linear(x, lin.weight.float(), lin.bias), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_torch_reference_backend_over_a_16bit_pool(kv_dtype: torch.dtype) -> None:
    """The torch path (no kernels; prefill with context everywhere) writes float32 K/V rounded
    into a 16-bit pool and attends over them widened: decodes as the kernel does, a prefill
    chunk over its earlier context as float64 causal attention over the pool."""
    from tailserve.model.attention import AttentionMetadata
    from tailserve.model.attention.torch_ref import TorchAttentionBackend

    lens, bs, h, h_kv, d = [9, 40], 16, 4, 2, 64
    _, kv32, tables = make_pool(lens, h, h_kv, d, torch.float32, seed=4)
    kv = kv32.to(kv_dtype)
    g = torch.Generator().manual_seed(8)
    # step: sequence 0 decodes its 9th token, sequence 1 prefills tokens 32..39 of 40
    chunk = 8
    n = 1 + chunk
    qs = torch.randn(n, h, d, generator=g)
    ks, vs = torch.randn(n, h_kv, d, generator=g), torch.randn(n, h_kv, d, generator=g)
    pos = [8, *range(32, 40)]
    seqs = [0] + [1] * chunk
    slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs for s, p in zip(seqs, pos,
                                                                                strict=True)])
    meta = AttentionMetadata(
        num_decodes=1, slot_mapping=slots, query_start_loc=[0, 1, n], query_lens=[1, chunk],
        seq_lens_list=lens, seq_lens=torch.tensor(lens), block_tables=tables, block_size=bs,
        scale=0.125,
    )
    backend = TorchAttentionBackend()
    backend.begin_step(meta)
    out = backend.forward(qs, ks, vs, kv, meta)
    flat = kv.view(2, -1, h_kv, d)
    assert torch.equal(flat[0, slots], ks.to(kv_dtype))  # stored rounded, in its slots
    pool = kv.float()
    want = reference_decode(qs[:1], pool, tables[:1], lens[:1], 0.125)
    assert (out[:1].double() - want).abs().max().item() < 1e-5
    for j in range(chunk):  # query at position 32 + j sees keys 0 .. 32 + j
        ref = reference_decode(qs[1 + j : 2 + j], pool, tables[1:], [33 + j], 0.125)
        assert (out[1 + j].double() - ref[0]).abs().max().item() < 1e-5
