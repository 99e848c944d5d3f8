"""The compiled CPU kernels against plain torch on the same inputs, shape by shape."""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tailserve.model.layers import ApplyRope, RMSNorm, SiluAndMul
from tailserve.model.transforms import (
    FusedApplyRope,
    FusedRMSNorm,
    FusedSiluAndMul,
    KernelLinear,
    apply_cpu_kernels,
)
from tailserve.model.transforms.kernel_linear import panel_weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
ops = torch.ops.tailserve


def reference_decode(
    q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """One sequence at a time: gather its K/V by block table, softmax in float64."""
    _, _, bs, h_kv, d = kv.shape
    group = q.shape[1] // h_kv
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // bs)]
        k = kv[0, blocks].reshape(-1, h_kv, d)[:n].double()  # [n, H_kv, D]
        v = kv[1, blocks].reshape(-1, h_kv, d)[:n].double()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double() * scale, k)
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def make_pool(
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    bs: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * per_seq + 3
    kv = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    # Scattered, non-monotonic block ids, as a long-running pool hands them out.
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * per_seq].view(len(lens), -1)
    # q as the model produces it: a view into a wider [tokens, heads + kv_heads, D] buffer.
    q = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g).to(dtype)[:, :heads]
    return q, kv, tables.long()


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (8, 8, 64), (8, 1, 128), (4, 2, 32), (12, 1, 64), (40, 8, 64)],
    ids=["gqa3-d64", "mha-d64", "mqa-d128", "generic-d32", "group12", "40-heads-generic"],
)
@pytest.mark.parametrize(
    "lens",
    [[1, 7, 8, 9, 16, 17, 300, 33], [301, 2]],
    ids=["many-seqs", "few-seqs"],  # whole sequences per work item / (sequence, KV head)
)
def test_paged_decode_attention_float32(
    heads: int, kv_heads: int, head_dim: int, lens: list[int]
) -> None:
    q, kv, tables = make_pool(lens, heads, kv_heads, head_dim, torch.float32, seed=heads)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full(q.shape, float("nan"))
    ops.paged_decode_attention(out, q, kv, tables, torch.tensor(lens), scale)
    ref = reference_decode(q, kv, tables, lens, scale)
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("bs", [1, 5, 8, 12, 32])
@pytest.mark.parametrize("lens", [[1, 7, 8, 9, 16, 17, 300, 33], [301, 2]], ids=["many", "few"])
def test_paged_decode_attention_block_sizes(bs: int, lens: list[int]) -> None:
    """The kernel walks a block in chunks of up to eight tokens that never cross a block."""
    q, kv, tables = make_pool(lens, 9, 3, 64, torch.float32, seed=bs, bs=bs)
    out = torch.full(q.shape, float("nan"))
    ops.paged_decode_attention(out, q, kv, tables, torch.tensor(lens), 0.125)
    ref = reference_decode(q, kv, tables, lens, 0.125)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_paged_decode_attention_rising_and_extreme_scores() -> None:
    """The online softmax rescales its running sums whenever a later chunk holds a larger
    score: keys that grow along the context force a rescale at nearly every chunk, and scores
    spanning hundreds of units must neither overflow nor lose the winning tokens."""
    lens = [200, 64, 9, 130]
    q, kv, tables = make_pool(lens, 9, 3, 64, torch.float32, seed=11)
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // 16)]
        ramp = torch.linspace(0.1, 3.0, len(blocks) * 16).view(len(blocks), 16, 1, 1)
        kv[0, blocks] *= ramp
    q = q * 8
    out = torch.full(q.shape, float("nan"))
    ops.paged_decode_attention(out, q, kv, tables, torch.tensor(lens), 0.125)
    ref = reference_decode(q, kv, tables, lens, 0.125)
    assert (out.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_attention_half_types(dtype: torch.dtype) -> None:
    lens = [5, 40, 130]
    q, kv, tables = make_pool(lens, 9, 3, 64, dtype, seed=7)
    out = torch.empty(q.shape, dtype=dtype)
    ops.paged_decode_attention(out, q, kv, tables, torch.tensor(lens), 0.125)
    ref = reference_decode(q, kv, tables, lens, 0.125)
    assert (out.double() - ref).abs().max().item() < 2e-2


def test_paged_decode_attention_only_reads_its_context() -> None:
    """Tokens past each sequence's length (stale K/V in its last block) change nothing."""
    lens = [20, 3]
    q, kv, tables = make_pool(lens, 9, 3, 64, torch.float32, seed=3)
    first = torch.empty(q.shape)
    ops.paged_decode_attention(first, q, kv, tables, torch.tensor(lens), 0.125)
    kv[:, tables[0, 1], 4:] = 1e4  # slots 20.. of sequence 0's second block
    kv[:, tables[1, 0], 3:] = -1e4
    second = torch.empty(q.shape)
    ops.paged_decode_attention(second, q, kv, tables, torch.tensor(lens), 0.125)
    assert torch.equal(first, second)


def test_paged_decode_attention_rejects_context_beyond_table() -> None:
    q, kv, tables = make_pool([16], 9, 3, 64, torch.float32, seed=1)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="context 17 for a block table of 1 blocks"):
        ops.paged_decode_attention(out, q, kv, tables, torch.tensor([17]), 0.125)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("k,n", [(576, 960), (100, 13), (64, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(m: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = ops.skinny_linear(x, w, b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 12, 13, 64, 131])  # chunks of six rows
@pytest.mark.parametrize("k,n", [(576, 960), (37, 16), (1536, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear(m: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = ops.panel_linear(x, panel_weight(w), b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    # A strided view (a slice of a wider activation) gives the same answer.
    wide = torch.randn(m, k + 8, generator=g)
    wide[:, 3 : 3 + k] = x
    torch.testing.assert_close(ops.panel_linear(wide[:, 3 : 3 + k], panel_weight(w), b), got)


@pytest.mark.parametrize("k", [576, 37, 1, 2])  # even and odd K: the halves split at K // 2
def test_panel_linear_rows_do_not_depend_on_batch_mates(k: int) -> None:
    """Every row is (bias + first half) + second half, summed in k order, at any M: a
    sequence decoded alone gets bit for bit what it gets in a batch (one row reads the halves
    as two interleaved streams, more rows one after the other)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(13, k, generator=g)
    w = panel_weight(torch.randn(32, k, generator=g))
    b = torch.randn(32, generator=g)
    batched = ops.panel_linear(x, w, b)
    for i in range(13):
        assert torch.equal(ops.panel_linear(x[i : i + 1], w, b)[0], batched[i])
    for m in (2, 6, 7):
        assert torch.equal(ops.panel_linear(x[:m], w, b), batched[:m])


def test_panel_linear_rejects_bad_shapes() -> None:
    w = panel_weight(torch.randn(32, 24))
    with pytest.raises(RuntimeError, match="panels of K = 24"):
        ops.panel_linear(torch.randn(2, 25), w, None)
    with pytest.raises(RuntimeError, match="bad bias"):
        ops.panel_linear(torch.randn(2, 24), w, torch.randn(31))
    with pytest.raises(RuntimeError, match="float32"):
        ops.panel_linear(torch.randn(2, 24, dtype=torch.float64), w, None)
    assert ops.panel_linear(torch.randn(0, 24), w, None).shape == (0, 32)


def test_kernel_linear_keeps_two_copies_and_shared_weights() -> None:
    """Each path of a swapped linear gives F.linear's answer; a weight shared with another
    module (a tied LM head) stays shared, an unshared one with both copies is let go (its
    memory is freed), one without a panel copy is kept for the skinny kernel."""
    torch.manual_seed(0)
    model = nn.Module()
    model.a = nn.Linear(64, 32, bias=True)
    model.emb = nn.Embedding(48, 64)
    model.head = nn.Linear(64, 48, bias=False)
    model.head.weight = model.emb.weight
    model.odd = nn.Linear(60, 24, bias=False)  # not a multiple of 16: no panel copy
    ref = {name: (m.weight.detach().clone(), m.bias) for name, m in
           [("a", model.a), ("head", model.head), ("odd", model.odd)]}
    released = weakref.ref(model.a.weight)
    onednn = torch.backends.mkldnn.is_available()
    report = apply_cpu_kernels(model, compiled=True)
    assert report.swapped == {"Linear": 3}
    a, head, odd = model.a, model.head, model.odd
    assert isinstance(a, KernelLinear) and isinstance(head, KernelLinear)
    assert isinstance(odd, KernelLinear)
    assert a.panel is not None and a.skinny is False
    assert (a.weight is None) == onednn
    gc.collect()
    assert (released() is None) == onednn  # no module holds the unshared weight any more
    assert head.weight is model.emb.weight  # tied: kept for the embedding lookup
    assert head.panel is not None
    assert odd.panel is None and odd.skinny and odd.weight is not None
    # a: panel + packed, weight let go; head: panel + packed, shared; odd: packed, kept.
    copies = {"a": 2 - onednn, "head": 1 + onednn, "odd": int(onednn)}
    assert report.bytes_added == 4 * (64 * 32 * copies["a"] + 64 * 48 * copies["head"]
                                      + 60 * 24 * copies["odd"])
    # Rows 1-128 take the panel kernel (skinny up to 8 rows without a panel), more oneDNN.
    for name, rows in [("a", 1), ("a", 5), ("a", 33), ("a", 200), ("head", 1), ("head", 40),
                       ("head", 129), ("odd", 2), ("odd", 20), ("odd", 130)]:
        module = getattr(model, name)
        w, b = ref[name]
        x = torch.randn(rows, w.shape[1])
        torch.testing.assert_close(module(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_apply_cpu_kernels_swaps_exact_types_on_float32_cpu_only() -> None:
    """Plain norms, SwiGLU and rope become their fused forms (same weights, same answers);
    a subclass, which may compute something else, is left alone, and so is a bf16 model.
    Without the compiled ops only the linears change (oneDNN)."""

    class ScaledNorm(RMSNorm):  # a model feature the transform does not know
        pass

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Module()
        m.norm = RMSNorm(48, 1e-5)
        m.norm.weight.data.normal_()
        m.other = ScaledNorm(48, 1e-5)
        m.act = SiluAndMul()
        m.rope = ApplyRope()
        m.proj = nn.Linear(48, 16)
        return m

    model = build()
    plain = build()
    norm_weight = model.norm.weight
    report = apply_cpu_kernels(model, compiled=True)
    assert report.swapped == {"RMSNorm": 1, "SiluAndMul": 1, "ApplyRope": 1, "Linear": 1}
    assert report.num_swapped == 4
    assert type(model.norm) is FusedRMSNorm and model.norm.weight is norm_weight
    assert type(model.other) is ScaledNorm
    assert type(model.act) is FusedSiluAndMul and type(model.rope) is FusedApplyRope
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    torch.testing.assert_close(model.norm(x.clone()), plain.norm(x))
    got_h, got_r = model.norm(x.clone(), r.clone())
    want_h, want_r = plain.norm(x, r)
    torch.testing.assert_close(got_h, want_h)
    torch.testing.assert_close(got_r, want_r)
    gate_up = torch.randn(5, 96, generator=g)
    torch.testing.assert_close(model.act(gate_up), plain.act(gate_up))

    without = build()
    report = apply_cpu_kernels(without, compiled=False)
    assert report.swapped == ({"Linear": 1} if torch.backends.mkldnn.is_available() else {})
    assert type(without.norm) is RMSNorm and type(without.act) is SiluAndMul

    bf16 = build().to(torch.bfloat16)
    assert apply_cpu_kernels(bf16, compiled=True).swapped == {}
    assert type(bf16.norm) is RMSNorm and type(bf16.proj) is nn.Linear


def test_rms_norm_and_fused_residual_add() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g)
    for rows in (1, 5, 300):  # 300 rows takes the parallel path
        x = torch.randn(rows, 576, generator=g)
        r = torch.randn(rows, 576, generator=g)
        ref_r = x + r
        ref = F.rms_norm(ref_r, (576,), w, 1e-5)
        torch.testing.assert_close(ops.rms_norm(ref_r, w, 1e-5), ref)
        ops.fused_add_rms_norm(x, r, w, 1e-5)
        torch.testing.assert_close(r, ref_r)
        torch.testing.assert_close(x, ref)


def serial_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in float32 with each row's squares added one by one in index order (numpy's
    accumulate is that serial loop): the order the kernel keeps at every row count."""
    xn = x.numpy()
    ss = np.add.accumulate(xn * xn, axis=1, dtype=np.float32)[:, -1:]
    n = np.float32(x.shape[1])
    inv = np.float32(1) / np.sqrt(ss / n + np.float32(eps))
    return torch.from_numpy(xn * inv * w.numpy())


def test_rms_norm_adds_each_rows_squares_in_order() -> None:
    # 16-row blocks side by side (AVX512) and a ragged last block must not change a row's bits.
    g = torch.Generator().manual_seed(1)
    for n in (576, 64):
        w = torch.randn(n, generator=g)
        for rows in (1, 16, 17, 40, 300):
            x = torch.randn(rows, n, generator=g) * 3
            x[0, :7] = 0
            assert torch.equal(ops.rms_norm(x, w, 1e-5), serial_rms_norm(x, w, 1e-5))
            r = torch.randn(rows, n, generator=g)
            want_r = x + r
            want = serial_rms_norm(want_r, w, 1e-5)
            ops.fused_add_rms_norm(x, r, w, 1e-5)
            assert torch.equal(r, want_r) and torch.equal(x, want)


def test_silu_and_mul_is_the_same_at_every_vector_width() -> None:
    # half = 24: lanes 0-15 take the 16-wide loop (where the CPU has AVX512), 16-23 the 8-wide
    # one; the same gate and up values in both must give the same bits.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 48, generator=g) * 6
    x[0, :8] = torch.tensor([-100.0, -30.0, -1e-6, 0.0, -0.0, 1e-6, 30.0, 88.0])
    x[:, 16:24] = x[:, 0:8]
    x[:, 40:48] = x[:, 24:32]
    y = ops.silu_and_mul(x)
    assert torch.equal(y[:, 16:24], y[:, 0:8])


def test_silu_and_mul() -> None:
    g = torch.Generator().manual_seed(0)
    for rows in (1, 64):
        x = torch.randn(rows, 2 * 1536, generator=g) * 4
        x[0, :8] = torch.tensor([-100.0, -30.0, -1e-6, 0.0, 1e-6, 30.0, 100.0, 88.0])
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up)


def test_rope_in_place_matches_torch_rope() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, d = 37, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, -1, d)  # strided, as in the model
    angles = torch.rand(tokens, 1, d // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    expected = ApplyRope()(qk.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    result = FusedApplyRope()(qk, cos, sin)
    assert result.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


def test_work_pool_serves_concurrent_callers() -> None:
    """Kernels called from several threads at once (two engines in one process) all finish
    with the right answer: a second caller runs serially instead of waiting on the pool."""
    import threading

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 576, generator=g)
    x = torch.randn(1, 576, generator=g)
    expected = F.linear(x, w)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(200):
                got = ops.skinny_linear(x, w, None)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    ops.set_kernel_spin_us(0)  # workers sleep between calls: the wake-up path is exercised
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        ops.set_kernel_spin_us(200)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
