"""write_kv_cache and paged_prefill_attention against plain torch on the same inputs, and the
CPU kernel backend against the reference backend on mixed steps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tailserve.kernels import QUANT_ISAS, isa_info, set_quant_isa
from tailserve.model.attention import AttentionMetadata
from tailserve.model.attention.cpu_kernels import CpuKernelAttentionBackend
from tailserve.model.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
ops = torch.ops.tailserve


# Against float64: float32 dots (measured max error 1.0e-5). At the avx512bf16 level q, K, the
# probabilities and V are rounded to bf16 (8 significant bits: 2^-9 relative) before dots
# summed in float32: a score moves by ~1% of a logit, a weight by ~1%, and an output by up to
# ~1% of V's scale (V ~ N(0, 4) here: measured max error 0.049 over 200 cases of these shapes,
# up to 512 x 512 causal; the float32 path's 1.0e-5).
FLOAT32_TOL = {"rtol": 1e-4, "atol": 2e-5}
# The amx level's split bf16 operands (hi + lo, three tile products): measured at most 7e-5
# off float64 on these cases, float32 FMAs 1e-5, one bf16 rounding 4e-2.
SPLIT_TOL = {"rtol": 1e-3, "atol": 2e-4}
BF16_TOL = {"rtol": 2e-2, "atol": 6e-2}


def tol() -> dict[str, float]:
    """The tolerance of the level in use."""
    level = isa_info().level
    if level in ("avx512bf16", "amx-bf16"):
        return BF16_TOL
    return SPLIT_TOL if level == "amx" else FLOAT32_TOL


@pytest.fixture(params=["auto", "amx-bf16", "avx512bf16", "avx512vnni", "avx2", "scalar"])
def isa(cpu_kernels: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel's vector paths, chosen at run time: the best this CPU has ("auto": float32
    FMAs), the opt-in AMX bf16 tiles, the opt-in bf16 dots, AVX512's float32 FMAs
    (avx512vnni: the same attention as avx512), the AVX2 baseline and the scalar one, forced
    as TAILSERVE_QUANT_ISA would."""
    set_quant_isa("auto")
    top = isa_info().supported
    if request.param == "amx-bf16":  # beside the order: AMX's tiles with AMX-BF16
        if top != "amx" or not isa_info().amx_bf16:
            pytest.skip(f"needs AMX-BF16 tiles (this CPU/build: {top}, "
                        f"{isa_info().amx_reason or 'no AMX-BF16'})")
    elif QUANT_ISAS[request.param] > QUANT_ISAS[top]:
        pytest.skip(f"this CPU's highest level is {top}")
    set_quant_isa(request.param)
    yield request.param
    set_quant_isa("auto")


def reference_prefill(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                      ctx: list[int], new: list[int], scale: float) -> torch.Tensor:
    """float64, one sequence at a time: its K/V gathered by block table, a causal mask."""
    _, _, bs, h_kv, d = kv.shape
    group = q.shape[1] // h_kv
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for i, (c, n) in enumerate(zip(ctx, new, strict=True)):
        blocks = tables[i, : -(-c // bs)]
        k = kv[0, blocks].reshape(-1, h_kv, d)[:c].double().repeat_interleave(group, dim=1)
        v = kv[1, blocks].reshape(-1, h_kv, d)[:c].double().repeat_interleave(group, dim=1)
        qi = q[start:start + n].double() * scale  # [n, H, D]
        scores = torch.einsum("nhd,thd->hnt", qi, k)
        pos = torch.arange(c - n, c)[:, None]
        scores = scores.masked_fill(torch.arange(c)[None, :] > pos, float("-inf"))
        out[start:start + n] = torch.einsum("hnt,thd->nhd", scores.softmax(-1), v)
        start += n
    return out


def make_case(ctx: list[int], new: list[int], heads: int, kv_heads: int, d: int,
              dtype: torch.dtype, bs: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-c // bs) for c in ctx)
    num_blocks = len(ctx) * per_seq + 2
    kv = (torch.randn(2, num_blocks, bs, kv_heads, d, generator=g) * 2).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(ctx) * per_seq].view(len(ctx), -1)
    # q as the model makes it: a view into the [tokens, heads + 2 * kv_heads, D] qkv rows.
    q = torch.randn(sum(new), heads + 2 * kv_heads, d, generator=g)[:, :heads]
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int64)
    return q, kv, tables.long(), torch.tensor(ctx, dtype=torch.int64), qsl


@pytest.mark.parametrize("ctx,new", [
    ([1], [1]),
    ([17], [17]),  # a whole prompt, one past a block
    ([300, 45, 33], [130, 45, 1]),  # chunks over earlier context, a fresh prompt, a decode-like row
    ([64, 16], [15, 16]),
    # Few items over long context: their keys are cut into parts and merged; in the second,
    # the last part (key 768 alone) is visible to the chunk's last token only.
    ([700, 5], [24, 5]),
    ([769], [20]),
    ([1100, 40], [300, 40]),  # long enough for the amx level's split tiles
], ids=["one", "fresh", "mixed", "blocks", "split", "split-tail", "long"])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (2, 1, 128), (3, 1, 64)])
def test_paged_prefill_attention_matches_float64(isa: str, ctx: list[int], new: list[int],
                                                 heads: int, kv_heads: int, d: int) -> None:
    q, kv, tables, lens, qsl = make_case(ctx, new, heads, kv_heads, d, torch.float32, 16, seed=1)
    scale = d ** -0.5
    out = torch.full(q.shape, float("nan"))
    ops.paged_prefill_attention(out, q, kv, tables, lens, qsl, 0, scale)
    want = reference_prefill(q, kv, tables, ctx, new, scale)
    torch.testing.assert_close(out.double(), want, **tol())


def test_amx_level_splits_long_calls_and_keeps_short_ones_on_float32(cpu_kernels: None) -> None:
    """The amx level: a long call on split bf16 tiles (not float32's bits, near float32's
    error, far below one bf16 rounding's); a call under the split's bar on float32 FMAs,
    bit for bit the avx512 levels' answer."""
    set_quant_isa("auto")
    if isa_info().supported != "amx" or not isa_info().amx_bf16:
        pytest.skip(f"needs AMX-BF16 tiles (this CPU/build: {isa_info().supported}, "
                    f"{isa_info().amx_reason or 'no AMX-BF16'})")

    def run(level: str, ctx: list[int], new: list[int]) -> tuple[torch.Tensor, float]:
        q, kv, tables, lens, qsl = make_case(ctx, new, 9, 3, 64, torch.float32, 16, seed=8)
        out = torch.full(q.shape, float("nan"))
        set_quant_isa(level)
        try:
            ops.paged_prefill_attention(out, q, kv, tables, lens, qsl, 0, 0.125)
        finally:
            set_quant_isa("auto")
        want = reference_prefill(q, kv, tables, ctx, new, 0.125)
        return out, (out.double() - want).abs().max().item()

    long_ctx, long_new = [900], [200]
    split, split_err = run("amx", long_ctx, long_new)
    fma, fma_err = run("avx512vnni", long_ctx, long_new)
    _, bf16_err = run("amx-bf16", long_ctx, long_new)
    assert not torch.equal(split, fma)  # the tiles ran
    assert split_err < SPLIT_TOL["atol"] and split_err < bf16_err / 50, (split_err, bf16_err)
    assert fma_err < split_err
    short, _ = run("amx", [64], [64])
    assert torch.equal(short, run("avx512vnni", [64], [64])[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [1, 5, 32])
def test_paged_prefill_attention_half_pools_and_block_sizes(dtype: torch.dtype, bs: int) -> None:
    ctx, new = [70, 9], [38, 9]
    q, kv, tables, lens, qsl = make_case(ctx, new, 6, 2, 32, dtype, bs, seed=2)
    out = torch.empty(q.shape)
    ops.paged_prefill_attention(out, q, kv, tables, lens, qsl, 0, 0.2)
    want = reference_prefill(q, kv.float(), tables, ctx, new, 0.2)
    torch.testing.assert_close(out.double(), want, **tol())


def test_paged_prefill_attention_leaves_rows_before_first_seq() -> None:
    """Rows of the sequences before first_seq (a step's decodes) are not written."""
    ctx, new = [5, 40], [1, 20]
    q, kv, tables, lens, qsl = make_case(ctx, new, 4, 2, 16, torch.float32, 16, seed=3)
    out = torch.full(q.shape, 7.0)
    ops.paged_prefill_attention(out, q, kv, tables, lens, qsl, 1, 0.25)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    want = reference_prefill(q, kv, tables, ctx, new, 0.25)
    torch.testing.assert_close(out[1:].double(), want[1:], **tol())


def test_paged_prefill_attention_rejects_bad_inputs() -> None:
    q, kv, tables, lens, qsl = make_case([20], [20], 4, 2, 16, torch.float32, 16, seed=4)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="new tokens, context"):
        ops.paged_prefill_attention(out, q, kv, tables, torch.tensor([10]), qsl, 0, 1.0)
    with pytest.raises(RuntimeError, match="block table"):
        ops.paged_prefill_attention(out, q, kv, tables[:, :1], lens, qsl, 0, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        narrow = kv[..., :8].contiguous()
        ops.paged_prefill_attention(out[..., :8], q[..., :8], narrow, tables, lens, qsl, 0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_matches_index_copy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    kv = torch.zeros(2, 6, 4, 3, 16, dtype=dtype)
    qkv = torch.randn(7, 9 + 6, 16, generator=g)
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([3, 0, 23, 9, 10, 11, 17])
    ops.write_kv_cache(kv, k, v, slots)
    want = torch.zeros_like(kv)
    want[0].view(-1, 3, 16).index_copy_(0, slots, k.to(dtype))
    want[1].view(-1, 3, 16).index_copy_(0, slots, v.to(dtype))
    assert torch.equal(kv, want)  # the same bits as torch's rounding
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.write_kv_cache(kv, k, v, torch.tensor([0, 1, 2, 3, 4, 5, 24]))


def test_backend_matches_reference_backend_on_a_mixed_step() -> None:
    """Decodes and prefill chunks in one step: the same K/V written (bit for bit) and the same
    attention as the torch reference backend."""
    ctx, new = [50, 31, 200, 8], [1, 1, 77, 8]
    q, kv, tables, lens, qsl = make_case(ctx, new, 9, 3, 64, torch.float32, 16, seed=6)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(sum(new), 3, 64, generator=g)
    v = torch.randn(sum(new), 3, 64, generator=g)
    slots = torch.tensor([int(tables[i, p // 16]) * 16 + p % 16
                          for i, (c, n) in enumerate(zip(ctx, new, strict=True))
                          for p in range(c - n, c)])
    meta = AttentionMetadata(
        num_decodes=2, slot_mapping=slots, query_start_loc=qsl.tolist(), query_lens=new,
        seq_lens_list=ctx, seq_lens=lens, block_tables=tables, block_size=16, scale=0.125,
    )
    kv_ref = kv.clone()
    ref = TorchAttentionBackend()
    ref.begin_step(meta)
    want = ref.forward(q, k, v, kv_ref, meta)
    fast = CpuKernelAttentionBackend()
    fast.begin_step(meta)
    got = fast.forward(q, k, v, kv, meta)
    assert torch.equal(kv, kv_ref)
    torch.testing.assert_close(got, want, **tol())
