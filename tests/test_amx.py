"""AMX tiles (kernels/csrc/quant_amx.cpp, quant_amx_bf16.cpp, prefill_amx.cpp): the int8 tile
products are VNNI's bit for bit (the amx level "auto" chooses); the opt-in amx-bf16 level's
products and prefill attention are held to float64 references with stated tolerances. Every
test here needs a CPU with AMX and Linux's tile permission, and skips with the reason
elsewhere (tests/test_isa.py checks the reason is reported)."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import pytest
import torch

from tailserve.kernels import cpu_ops_available, isa_info, set_quant_isa
from tailserve.model.quant.formats import (
    PACKED_FORMATS,
    BlockFormat,
    dequantize_reference,
    tile_blocks,
)
from test_quant_kernels import random_blocks

pytestmark = pytest.mark.usefixtures("cpu_kernels")
ops = torch.ops.tailserve
Q = gguf.GGMLQuantizationType
TILED = [PACKED_FORMATS[t] for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)]
IDS = [f.name for f in TILED]


def _amx() -> str | None:
    """Why AMX cannot run here, or None."""
    if not cpu_ops_available():
        return "the CPU kernels are not built"
    info = isa_info()
    if info.supported != "amx":
        return f"no AMX tile kernels here: {info.amx_reason or 'the build did not target AMX'}"
    return None


@pytest.fixture
def amx() -> Iterator[None]:
    reason = _amx()
    if reason is not None:
        pytest.skip(reason)
    yield
    set_quant_isa("auto")


@pytest.mark.parametrize("fmt", TILED, ids=IDS)
def test_int8_tiles_are_vnni_bit_for_bit(amx: None, fmt: BlockFormat) -> None:
    """Ragged shapes: rows not a multiple of 16 (the rest on VNNI's passes), an odd number of
    blocks (the pipelined pairs' last block alone), one block; with and without bias."""
    for n, k in ((48, 32), (32, 7 * 32), (64, 18 * 32)):
        t = tile_blocks(random_blocks(fmt, n, k, seed=k))
        for rows in (16, 17, 31, 48, 70):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x[0, :32] = 0  # a block of zeros: scale 0
            for bias in (None, torch.randn(n)):
                set_quant_isa("avx512vnni")
                want = ops.quant_linear(x, t, bias)
                assert set_quant_isa("amx") == "amx"
                assert torch.equal(ops.quant_linear(x, t, bias), want), (n, k, rows)


KQUANTS = [PACKED_FORMATS[t] for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K)]


@pytest.mark.parametrize("fmt", KQUANTS, ids=[f.name for f in KQUANTS])
def test_int8_tiles_on_kquants_are_vnni_panels_bit_for_bit(amx: None, fmt: BlockFormat) -> None:
    """The K-quants as stored (quant_amx_kquant.cpp): 9 rows and up, rows of x padded to whole
    groups of 16 (9, 17, 31, 70), N not a multiple of 16 (40: a partial tile of weight rows),
    one and several super-blocks, a block of x all zeros; with and without bias. At 8 rows
    both levels take the decode rows."""
    for n, k in ((48, 256), (40, 512), (64, 3 * 256)):
        w = random_blocks(fmt, n, k, seed=k + n)
        for rows in (8, 9, 16, 17, 31, 70):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x[0, :32] = 0
            for bias in (None, torch.randn(n)):
                set_quant_isa("avx512vnni")
                want = ops.quant_linear(x, w, bias)
                assert set_quant_isa("amx") == "amx"
                assert torch.equal(ops.quant_linear(x, w, bias), want), (n, k, rows)


# amx-bf16 against float64 x @ W^T (W the exact dequantized blocks): x and W rounded to bf16
# (2^-9 relative each), float32 sums. Measured relative error (Frobenius) 4e-4 .. 3.1e-3 on
# these shapes, about half the int8 path's (9e-4 .. 5.4e-3): the bound is the int8 path's own.
BF16_PRODUCT_RTOL = 6e-3


def _bf16_against_float64(x: torch.Tensor, w: torch.Tensor, exact_w: torch.Tensor,
                          bias: torch.Tensor, case: object) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ W^T + bias at amx-bf16 (asserted within BF16_PRODUCT_RTOL of float64) and at VNNI."""
    exact = x.double() @ exact_w.T + bias.double()
    set_quant_isa("avx512vnni")
    vnni = ops.quant_linear(x, w, bias)
    assert set_quant_isa("amx-bf16") == "amx-bf16"
    got = ops.quant_linear(x, w, bias)
    err = ((got.double() - exact).norm() / exact.norm()).item()
    assert err < BF16_PRODUCT_RTOL, (case, err)
    return got, vnni


@pytest.mark.parametrize("fmt", TILED, ids=IDS)
def test_bf16_tiles_against_float64(amx: None, fmt: BlockFormat) -> None:
    if not isa_info().amx_bf16:
        pytest.skip("the CPU has no AMX-BF16")
    for n, k in ((48, 32), (48, 7 * 32), (80, 18 * 32)):
        w = random_blocks(fmt, n, k, seed=n + k)
        t = tile_blocks(w)
        exact_w = dequantize_reference(w).double()
        for rows in (16, 37, 64):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            bias = torch.randn(n)
            got, vnni = _bf16_against_float64(x, t, exact_w, bias, (fmt.name, n, k, rows))
            done = 16 * (rows // 16)  # rows past the last whole group run VNNI's path
            assert torch.equal(got[done:], vnni[done:])
            assert not torch.equal(got[:done], vnni[:done])  # the tiles did run


STORED = [PACKED_FORMATS[t] for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_1, Q.Q8_0)]


@pytest.mark.parametrize("fmt", STORED, ids=[f.name for f in STORED])
def test_bf16_tiles_on_stored_blocks_against_float64(amx: None, fmt: BlockFormat) -> None:
    """Weights as stored ([N, blocks, type_size]: the K-quants are never tiled) on the same
    bf16 tiles: each 16-row tile unpacked as the panels unpack it. Rows past the last whole
    group, and N not a multiple of 16, take the int8 path: VNNI's numbers (9+ rows of a
    K-quant on the int8 tiles, the panels' bits)."""
    if not isa_info().amx_bf16:
        pytest.skip("the CPU has no AMX-BF16")
    for n, k in ((32, 256), (48, 3 * 256), (40, 256)):
        w = random_blocks(fmt, n, k, seed=n + k)
        exact_w = dequantize_reference(w).double()
        for rows in (16, 37):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            bias = torch.randn(n)
            got, vnni = _bf16_against_float64(x, w, exact_w, bias, (fmt.name, n, k, rows))
            done = 16 * (rows // 16) if n % 16 == 0 else 0
            # The rest is VNNI's product of those rows alone (fewer than 9 rows of x take the
            # decode-row path, not the panels a 37-row product takes).
            set_quant_isa("avx512vnni")
            rest = ops.quant_linear(x[done:].contiguous(), w, bias)
            assert torch.equal(got[done:], rest)
            if done:
                assert not torch.equal(got[:done], vnni[:done])  # the tiles did run


@pytest.mark.parametrize("fmt", [PACKED_FORMATS[Q.Q4_0], PACKED_FORMATS[Q.Q4_K]],
                         ids=["Q4_0", "Q4_K"])
def test_bf16_tiles_in_row_passes(amx: None, fmt: BlockFormat) -> None:
    """A product whose packed x would not stay in L2 runs in passes of rows (at K = 6,144,
    256 rows a pass; quant_amx_bf16.cpp rows_per_pass): of 600 rows, 256 + 256 + 80 on the
    tiles and the last 8 on VNNI's path; each range the same numbers as its rows alone, the
    whole within the float64 bound."""
    if not isa_info().amx_bf16:
        pytest.skip("the CPU has no AMX-BF16")
    n, k = 32, 6144
    w = random_blocks(fmt, n, k, seed=5)
    t = tile_blocks(w) if fmt.name == "Q4_0" else w
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(n)
    got, _ = _bf16_against_float64(x, t, dequantize_reference(w).double(), bias, fmt.name)
    for r0, r1 in ((0, 256), (256, 512), (512, 600)):
        alone = ops.quant_linear(x[r0:r1].contiguous(), t, bias)
        assert torch.equal(got[r0:r1], alone), (fmt.name, r0, r1)


def test_levels(amx: None) -> None:
    assert set_quant_isa("auto") == "amx"  # the bit-identical one; amx-bf16 is opt-in
    if isa_info().amx_bf16:
        assert set_quant_isa("amx-bf16") == "amx-bf16" and isa_info().level == "amx-bf16"
    assert set_quant_isa("auto") == "amx"
    assert torch.ops.tailserve.amx_peak(False, 1 << 12) > 0
