"""paged_decode_attention's context split (csrc/decode_split.h): with few (sequence, KV head)
items for the threads, each item's context runs in parts merged by log-sum-exp. At every
instruction set level against the float64 reference; the AVX512 parts give the AVX2 bits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tailserve.kernels import set_quant_isa
from test_cpu_kernels import make_pool, reference_decode
from test_decode_attention_isa import POOLS, attend, check_rising_scores, isa, levels

pytestmark = pytest.mark.usefixtures("cpu_kernels")
__all__ = ["isa"]  # the per-level fixture, shared with test_decode_attention_isa

# (threads, lens): the split as decode_split.h plans it for 3 KV heads (parts of >= 256 tokens,
# 16-aligned). Two threads, one sequence: 2 parts per head (512: 2 x 256, a multiple of the
# part; 513: 272 + 241; 1000: 512 + 488); two sequences: 2 parts each, or one split and one
# too short to split; four threads: 1025 tokens in 3 x 272 + 209.
CASES = [
    (2, [512]),
    (2, [513]),
    (2, [1000]),
    (2, [512, 512]),
    (2, [520, 2]),
    (4, [1025]),
    (4, [700, 900]),
]
# The same with the shortest part set to 1 token (set_decode_split_tokens): parts of a few
# tokens. 33 on two threads: 32 + 1; 49 on four: 3 x 16 + 1; 3: one part of 3 (a merge of
# one); 17 and 40 on four: 16 + 1 and 32 + 8.
TINY = [(2, [33]), (4, [49]), (2, [3]), (4, [17, 40])]
# (heads, kv_heads, head_dim): SmolLM2's GQA, MHA, head_dim 128, and the generic path (d32).
SHAPES = [(9, 3, 64), (8, 8, 64), (4, 1, 128), (4, 2, 32)]


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    torch.ops.tailserve.set_decode_split_tokens(0)


def split_inputs(lens: list[int], shape: tuple[int, int, int], dtype: torch.dtype, bs: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv_heads, head_dim = shape
    q, kv, tables = make_pool(lens, heads, kv_heads, head_dim, dtype, seed=sum(lens) + bs, bs=bs)
    return q.float(), kv, tables


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("dtype", POOLS, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa3-d64", "mha-d64", "mqa-d128", "generic-d32"])
def test_split_matches_the_reference(isa: str, shape: tuple[int, int, int],
                                     dtype: torch.dtype) -> None:
    for tokens, cases in ((0, CASES), (1, TINY)):
        torch.ops.tailserve.set_decode_split_tokens(tokens)
        check_cases(cases, shape, dtype)


def check_cases(cases: list[tuple[int, list[int]]], shape: tuple[int, int, int],
                dtype: torch.dtype) -> None:
    for n_threads, lens in cases:
        torch.set_num_threads(n_threads)
        for bs in (16, 5):  # block size 5: parts start and end inside blocks
            q, kv, tables = split_inputs(lens, shape, dtype, bs)
            ref = reference_decode(q, kv.float(), tables, lens, 0.125)
            err = (attend(q, kv, tables, lens).double() - ref).abs().max().item()
            assert err < 1e-5, (n_threads, lens, bs)


@pytest.mark.usefixtures("threads")
def test_split_is_taken_and_deterministic(isa: str) -> None:
    """The parts' rounding differs from one pass's (so these shapes do split), and the same
    shapes give the same bits call after call whichever thread merges."""
    q, kv, tables = split_inputs([1000], (9, 3, 64), torch.float32, 16)
    torch.set_num_threads(1)
    whole = attend(q, kv, tables, [1000])
    torch.set_num_threads(2)
    split = attend(q, kv, tables, [1000])
    assert not torch.equal(whole, split)
    for _ in range(5):
        assert torch.equal(attend(q, kv, tables, [1000]), split)
    # On four threads 1000 tokens make 3 parts of >= 256, or 4 with the shortest part at 1.
    torch.set_num_threads(4)
    three = attend(q, kv, tables, [1000])
    torch.ops.tailserve.set_decode_split_tokens(1)
    assert not torch.equal(attend(q, kv, tables, [1000]), three)


@pytest.mark.usefixtures("threads")
def test_split_with_rising_scores(isa: str) -> None:
    """Keys growing along the context: each later part has a larger max, so the merge rescales
    every earlier part by a tiny factor."""
    torch.set_num_threads(2)
    lens = [700, 513]
    check_rising_scores(*split_inputs(lens, (9, 3, 64), torch.float32, 16), lens)


@pytest.mark.usefixtures("threads")
def test_split_in_16_bits(isa: str) -> None:
    """q and out in the pool's 16-bit dtype (the generic path at every level)."""
    torch.set_num_threads(2)
    for dtype in (torch.bfloat16, torch.float16):
        q, kv, tables = make_pool([513], 9, 3, 64, dtype, seed=3)
        ref = reference_decode(q.float(), kv.float(), tables, [513], 0.125)
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        torch.ops.tailserve.paged_decode_attention(out, q, kv, tables, torch.tensor([513]), 0.125)
        assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("dtype", POOLS, ids=["f32", "bf16", "f16"])
def test_split_avx512_gives_the_avx2_bits(dtype: torch.dtype) -> None:
    if "avx512" not in levels():
        pytest.skip(f"this CPU has no AVX512 (best: {set_quant_isa('auto')})")
    try:
        for shape in SHAPES[:3]:
            for n_threads, lens in CASES + TINY:
                torch.ops.tailserve.set_decode_split_tokens(1 if (n_threads, lens) in TINY else 0)
                torch.set_num_threads(n_threads)
                q, kv, tables = split_inputs(lens, shape, dtype, 16)
                outs = []
                for level in ("avx2", "avx512"):
                    set_quant_isa(level)
                    outs.append(attend(q, kv, tables, lens))
                assert torch.equal(outs[0], outs[1]), (shape, n_threads, lens)
    finally:
        set_quant_isa("auto")
        torch.ops.tailserve.set_decode_split_tokens(0)


def test_split_tokens_knob_checks_its_input() -> None:
    ops = torch.ops.tailserve
    assert ops.set_decode_split_tokens(0) == 256  # the default, restored
    with pytest.raises(RuntimeError, match="must be >= 0"):
        ops.set_decode_split_tokens(-1)
    assert ops.set_decode_split_tokens(0) == 256
