"""paged_decode_attention at every instruction set level this CPU has, chosen at run time as
TAILSERVE_QUANT_ISA chooses it: each against the float64 reference, and the AVX512 kernel
against the AVX2 one bit for bit (the level must never change a token)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tailserve.kernels import QUANT_ISAS, set_quant_isa
from test_cpu_kernels import make_pool, reference_decode

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
ops = torch.ops.tailserve

# (heads, kv_heads, head_dim): SmolLM2's GQA, MHA, head_dim 128, one KV head for twelve.
SHAPES = [(9, 3, 64), (8, 8, 64), (4, 1, 128), (12, 1, 64)]
# Many sequences (whole sequences per work item) and few ((sequence, KV head) items); with
# block size 5 every chunk is short (1-5 tokens), so the masked lanes are exercised.
LENS = {"many": [1, 7, 8, 9, 16, 17, 70, 33], "few": [131, 2]}
POOLS = [torch.float32, torch.bfloat16, torch.float16]


def levels() -> list[str]:
    best = QUANT_ISAS[set_quant_isa("auto")]
    return [n for n in ("scalar", "avx2", "avx512") if QUANT_ISAS[n] <= best]


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param not in levels():
        pytest.skip(f"this CPU has no {request.param} (best: {set_quant_isa('auto')})")
    set_quant_isa(request.param)
    yield request.param
    set_quant_isa("auto")


def attend(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: list[int]
           ) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"))
    ops.paged_decode_attention(out, q, kv, tables, torch.tensor(lens), 0.125)
    return out


@pytest.mark.parametrize("dtype", POOLS, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa3-d64", "mha-d64", "mqa-d128", "group12"])
def test_every_level_matches_the_reference(isa: str, shape: tuple[int, int, int],
                                           dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = shape
    for name, lens in LENS.items():
        q, kv, tables = make_pool(lens, heads, kv_heads, head_dim, dtype, seed=len(name),
                                  bs=5 if name == "many" else 16)
        q = q.float()  # float32 queries over the pool's dtype, as decode_layers calls it
        ref = reference_decode(q, kv.float(), tables, lens, 0.125)
        assert (attend(q, kv, tables, lens).double() - ref).abs().max().item() < 1e-5, name


def check_rising_scores(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                        lens: list[int]) -> None:
    """Keys scaled up along each context (blocks of 16 tokens) and sharper queries: the max
    grows chunk after chunk, so the online softmax (and a split's merge) rescales nearly
    every time. Within 1e-4 of the float64 reference."""
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // 16)]
        kv[0, blocks] *= torch.linspace(0.1, 3.0, len(blocks) * 16).view(len(blocks), 16, 1, 1)
    q = q * 8
    ref = reference_decode(q, kv, tables, lens, 0.125)
    assert (attend(q, kv, tables, lens).double() - ref).abs().max().item() < 1e-4


def test_rising_scores_at_every_level(isa: str) -> None:
    """Keys growing along the context make the online softmax rescale at nearly every chunk."""
    lens = [200, 64, 9, 130]
    check_rising_scores(*make_pool(lens, 9, 3, 64, torch.float32, seed=11), lens)


@pytest.mark.parametrize("dtype", POOLS, ids=["f32", "bf16", "f16"])
def test_avx512_gives_the_avx2_bits(dtype: torch.dtype) -> None:
    if "avx512" not in levels():
        pytest.skip(f"this CPU has no AVX512 (best: {set_quant_isa('auto')})")
    try:
        for heads, kv_heads, head_dim in SHAPES:
            for bs in (5, 16):
                for lens in LENS.values():
                    q, kv, tables = make_pool(lens, heads, kv_heads, head_dim, dtype,
                                              seed=heads + bs, bs=bs)
                    q = q.float()
                    outs = []
                    for level in ("avx2", "avx512"):
                        set_quant_isa(level)
                        outs.append(attend(q, kv, tables, lens))
                    assert torch.equal(outs[0], outs[1]), (heads, kv_heads, head_dim, bs, lens)
    finally:
        set_quant_isa("auto")
