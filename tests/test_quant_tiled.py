"""GGUF blocks in tiles of 16 rows (``quant.formats.tile_blocks``, kernels/csrc/quant_tiled.cpp):
the layout against the stored one, and quant_linear / quant_embedding on it against references.

The tiled kernels compute each output as one fixed sequence of float operations in every
instruction-set path (the integer sums are exact), so the paths are compared bit for bit; against
the stored-block kernel, which adds the same terms in another order, within 2e-6 relative.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from tailserve.kernels import set_quant_isa
from tailserve.model.gguf import read_gguf
from tailserve.model.loader import default_model_path
from tailserve.model.quant.formats import (
    PACKED_FORMATS,
    BlockFormat,
    dequantize_reference,
    format_of,
    is_packed,
    is_tiled,
    logical_shape,
    tile_blocks,
    untile_blocks,
)
from test_quant_kernels import (  # noqa: F401 (isa: the fixture)
    _SCALES,
    ACTIVATION_QUANT_RTOL,
    emulated_linear,
    isa,
    isa_levels,
    random_blocks,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
ops = torch.ops.tailserve
Q = gguf.GGMLQuantizationType
TILED = [PACKED_FORMATS[t] for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)]
TILED_IDS = [f.name for f in TILED]
STORED_RTOL = 2e-6  # tiled vs stored-block kernel: the same terms, added in another order


@pytest.mark.parametrize("fmt", TILED, ids=TILED_IDS)
def test_tiles_hold_the_stored_bytes(fmt: BlockFormat) -> None:
    w = random_blocks(fmt, 48, 7 * 32, seed=2)
    t = tile_blocks(w)
    assert t.shape == (3, 7, 16, fmt.type_size) and is_tiled(t) and is_packed(t)
    assert (format_of(t), logical_shape(t), t.numel()) == (fmt, (48, 7 * 32), w.numel())
    assert torch.equal(untile_blocks(t), w)
    assert tile_blocks(t) is t  # already tiled
    assert torch.equal(dequantize_reference(t), dequantize_reference(w))
    assert torch.equal(ops.quant_dequantize(t), dequantize_reference(w))
    ids = torch.tensor([47, 0, 17, 17, 31])
    assert torch.equal(ops.quant_embedding(ids, t), dequantize_reference(w)[ids])


def test_what_stays_as_stored() -> None:
    odd = random_blocks(PACKED_FORMATS[Q.Q4_1], 40, 64, seed=0)  # 40 rows: no whole tiles
    kquant = random_blocks(PACKED_FORMATS[Q.Q4_K], 32, 256, seed=0)
    assert tile_blocks(odd) is odd and tile_blocks(kquant) is kquant
    floats = torch.randn(32, 64)
    assert tile_blocks(floats) is floats and untile_blocks(floats) is floats


@pytest.mark.usefixtures("isa")  # every instruction set this CPU has
@pytest.mark.parametrize("fmt", TILED, ids=TILED_IDS)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 20, 70])
def test_tiled_linear_matches_the_references(fmt: BlockFormat, rows: int) -> None:
    cols = 7 * 32  # an odd number of blocks
    w = random_blocks(fmt, 48, cols, seed=rows)
    t = tile_blocks(w)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g)
    x[0, :32] = 0  # an all-zero block: scale 0
    bias = torch.randn(48, generator=g)
    got = ops.quant_linear(x, t, bias).double()
    want = emulated_linear(x, w) + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ dequantize_reference(w).double().T + bias.double()
    assert ((got - exact).norm() / exact.norm()).item() < ACTIVATION_QUANT_RTOL
    stored = ops.quant_linear(x, w, bias)
    torch.testing.assert_close(got.float(), stored, rtol=STORED_RTOL,
                               atol=STORED_RTOL * stored.abs().max().item())


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("fmt", TILED, ids=TILED_IDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tiled_linear_at_the_bounds_of_its_integer_sums(fmt: BlockFormat, sign: float) -> None:
    """Every stored value at its largest magnitude (nibbles 15, fifth bits set, int8 -128)
    against x at +-127 in every lane: the 16-bit pair sums of AVX2's maddubs at their bound
    (Q8_0's |-128| x 127 x 2 = 32,512, Q5's 2 x 31 x 127 per half), where a saturated or
    wrapped sum would be off by thousands x the scale."""
    w = random_blocks(fmt, 32, 4 * 32, seed=7)
    scale_bytes = {b for offset, _ in _SCALES[fmt.name] for b in (offset, offset + 1)}
    values = [b for b in range(fmt.type_size) if b not in scale_bytes]
    w[..., values] = 0x80 if fmt.name == "Q8_0" else 0xFF
    x = torch.full((17, 4 * 32), sign)
    for rows in (1, 2, 3, 4, 17):  # 17: one AMX tile group and a row after it
        got = ops.quant_linear(x[:rows], tile_blocks(w), None).double()
        want = emulated_linear(x[:rows], w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt", TILED, ids=TILED_IDS)
def test_every_isa_gives_the_same_bits(fmt: BlockFormat) -> None:
    t = tile_blocks(random_blocks(fmt, 64, 9 * 32, seed=4))
    x = torch.randn(37, 9 * 32, generator=torch.Generator().manual_seed(4))
    outs = {}
    # 1-2 rows take AVX2's one-pass kernel, 3 its two-pass one, 13 the GEMM passes; at the
    # AMX level 16 is one tile group and 37 two groups and 5 rows on VNNI's GEMM passes.
    counts = (1, 2, 3, 13, 16, 37)
    for name in isa_levels():
        set_quant_isa(name)
        outs[name] = [ops.quant_linear(x[:rows], t, None) for rows in counts]
    set_quant_isa("auto")
    for name, got in outs.items():
        for rows, out, scalar in zip(counts, got, outs["scalar"], strict=True):
            assert torch.equal(out, scalar), (name, rows)
            assert torch.equal(out, got[-1][:rows]), (name, rows)  # decode and GEMM rows alike


def test_tiles_of_the_bundled_file() -> None:
    f = read_gguf(default_model_path())
    layer = f.packed("blk.3.ffn_down.weight")  # Q4_1 [576, 1536]
    embed = f.packed("token_embd.weight")[:4096].contiguous()  # Q8_0, the tied LM head
    g = torch.Generator().manual_seed(0)
    for stored, k in ((layer, 1536), (embed, 576)):
        tiled = tile_blocks(stored)
        for rows in (1, 8, 9, 33):
            x = torch.randn(rows, k, generator=g)
            want = ops.quant_linear(x, stored, None)
            got = ops.quant_linear(x, tiled, None)
            torch.testing.assert_close(got, want, rtol=STORED_RTOL,
                                       atol=STORED_RTOL * want.abs().max().item())
    table = tile_blocks(f.packed("token_embd.weight"))
    ids = torch.tensor([0, 1, 49151, 1234, 16])
    assert torch.equal(ops.quant_embedding(ids, table), f.dequantize("token_embd.weight")[ids])
    assert torch.equal(ops.quant_dequantize(tile_blocks(layer)),
                       f.dequantize("blk.3.ffn_down.weight"))


def test_tiled_input_checks() -> None:
    t = tile_blocks(random_blocks(PACKED_FORMATS[Q.Q8_0], 32, 64, seed=0))  # [2, 2, 16, 34]
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        ops.quant_linear(torch.randn(2, 32), t, None)
    with pytest.raises(RuntimeError, match="no ggml format has 19-byte blocks"):
        ops.quant_linear(x, torch.zeros(2, 2, 16, 19, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="a tiled weight is"):
        ops.quant_linear(x, t.view(4, 2, 8, 34), None)
    with pytest.raises(RuntimeError, match="a tiled weight is"):  # K-quants stay stored
        ops.quant_linear(torch.randn(2, 256), torch.zeros(1, 1, 16, 144, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="contiguous uint8 CPU tensor"):
        ops.quant_linear(x, t.transpose(0, 1), None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.quant_linear(x, t, torch.zeros(31))
    with pytest.raises(RuntimeError, match="id 32 outside"):
        ops.quant_embedding(torch.tensor([32]), t)
    assert ops.quant_linear(torch.zeros(0, 64), t, None).shape == (0, 32)
