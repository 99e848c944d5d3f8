"""The packed-GGUF kernels (quant_linear, quant_embedding, quant_dequantize) against references.

References: ``gguf``'s own numpy dequantizers for the values of every block format, and float64
torch for the products. ``quant_linear`` quantizes each row of x to int8 in blocks of 32 (as
llama.cpp does); ``emulated_linear`` does the same in torch, so the kernel is held to float
rounding (1e-5) against it, and to the activation quantization's error (stated below) against
the plain float64 product. Every instruction-set path this CPU has is run.
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from tailserve.kernels import QUANT_ISAS, set_quant_isa
from tailserve.model.gguf import read_gguf
from tailserve.model.loader import default_model_path
from tailserve.model.quant.formats import PACKED_FORMATS, BlockFormat, dequantize_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
ops = torch.ops.tailserve
Q = gguf.GGMLQuantizationType

# Relative error (Frobenius) of y against x @ W^T in float64 that int8 activations cost on
# Gaussian x: measured 4-6e-3 for every format; real activations (the model) do better.
ACTIVATION_QUANT_RTOL = 1.5e-2

# The fp16 fields of each format (byte offset, magnitude): random bytes elsewhere are valid.
_SCALES: dict[str, list[tuple[int, float]]] = {
    "Q4_0": [(0, 0.01)], "Q5_0": [(0, 0.01)], "Q8_0": [(0, 0.01)],
    "Q4_1": [(0, 0.01), (2, 0.1)], "Q5_1": [(0, 0.01), (2, 0.1)],
    "Q4_K": [(0, 1e-3), (2, 1e-3)], "Q5_K": [(0, 1e-3), (2, 1e-3)], "Q6_K": [(208, 1e-3)],
}


def random_blocks(fmt: BlockFormat, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    raw = g.integers(0, 256, size=(rows, nb, fmt.type_size), dtype=np.uint8)
    for offset, scale in _SCALES[fmt.name]:
        half = (g.uniform(-1, 1, size=(rows, nb)) * scale).astype(np.float16)
        raw[:, :, offset:offset + 2] = half.view(np.uint8).reshape(rows, nb, 2)
    return torch.from_numpy(raw)


def emulated_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x quantized per block of 32 as the kernel does (float32 arithmetic), then float64."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(blocks * inv)  # half to even, like nearbyint
    xe = (xq.double() * d.double()).view(m, k)
    return xe @ dequantize_reference(w).double().T


def isa_levels() -> list[str]:
    best = set_quant_isa("auto")
    return [name for name, level in QUANT_ISAS.items() if 0 <= level <= QUANT_ISAS[best]]


@pytest.fixture(params=["scalar", "avx2", "avx512", "avx512vnni", "amx"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param not in isa_levels():
        pytest.skip(f"this CPU has no {request.param} (best: {set_quant_isa('auto')})")
    set_quant_isa(request.param)
    yield request.param
    set_quant_isa("auto")


FORMATS = list(PACKED_FORMATS.values())
FORMAT_IDS = [f.name for f in FORMATS]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantize_matches_gguf_for_every_format(fmt: BlockFormat) -> None:
    cols = 3 * fmt.block_size  # odd block counts
    w = random_blocks(fmt, 37, cols, seed=1)
    assert torch.equal(ops.quant_dequantize(w), dequantize_reference(w))
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(ops.quant_embedding(ids, w), dequantize_reference(w)[ids])


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 3, 41])
def test_quant_linear_matches_the_emulated_product(
    isa: str, fmt: BlockFormat, rows: int
) -> None:
    cols = (3 if fmt.block_size == 256 else 7) * fmt.block_size  # 7 x 32: AVX512's 32 tail
    w = random_blocks(fmt, 37, cols, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g)
    x[0, :32] = 0  # an all-zero block: scale 0
    bias = torch.randn(37, generator=g)
    got = ops.quant_linear(x, w, bias).double()
    want = emulated_linear(x, w) + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ dequantize_reference(w).double().T + bias.double()
    assert ((got - exact).norm() / exact.norm()).item() < ACTIVATION_QUANT_RTOL


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_decode_rows_are_the_same_bits_at_every_vector_level(name: str) -> None:
    """The K-quants' decode rows (1-8 rows of x) at the VNNI level run two weight rows a zmm
    (quant_kquant_pairs.cpp), lane for lane the 8-lane kernel that AVX2 runs: the outputs are
    the same bits, odd and even row counts of W (the odd last row takes the 8-lane kernel),
    every count of x's rows the kernels specialize (1-4, and 7: a pass of 4 then 3), bias."""
    levels = [lv for lv in ("avx2", "avx512", "avx512vnni") if lv in isa_levels()]
    if "avx512vnni" not in levels:
        pytest.skip(f"this CPU has no AVX512-VNNI (best: {set_quant_isa('auto')})")
    fmt = next(f for f in FORMATS if f.name == name)
    try:
        for n in (37, 64):
            w = random_blocks(fmt, n, 3 * 256, seed=n)
            for rows in (1, 2, 3, 4, 7):
                g = torch.Generator().manual_seed(rows)
                x = torch.randn(rows, 3 * 256, generator=g)
                bias = torch.randn(n, generator=g)
                outs = {}
                for level in levels:
                    set_quant_isa(level)
                    outs[level] = ops.quant_linear(x, w, bias)
                assert all(torch.equal(outs["avx2"], y) for y in outs.values()), (n, rows)
    finally:
        set_quant_isa("auto")


def test_every_isa_computes_the_same_integer_sums() -> None:
    fmt = PACKED_FORMATS[Q.Q4_1]
    w = random_blocks(fmt, 40, 9 * 32, seed=3)
    x = torch.randn(5, 9 * 32, generator=torch.Generator().manual_seed(3))
    outs = {}
    for name in isa_levels():
        set_quant_isa(name)
        outs[name] = ops.quant_linear(x, w, None)
    set_quant_isa("auto")
    ref = outs["scalar"]
    for name, y in outs.items():  # only the order of float partial sums differs
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6 * ref.abs().max().item(),
                                   msg=name)


def test_blocks_of_the_bundled_file() -> None:
    f = read_gguf(default_model_path())
    layer = f.packed("blk.3.ffn_down.weight")  # Q4_1 [576, 1536]
    embed = f.packed("token_embd.weight")  # Q8_0 [49152, 576]
    assert (layer.shape, embed.shape) == ((576, 48, 20), (49152, 18, 34))
    assert torch.equal(ops.quant_dequantize(layer), f.dequantize("blk.3.ffn_down.weight"))
    ids = torch.tensor([0, 1, 49151, 1234])
    assert torch.equal(ops.quant_embedding(ids, embed), f.dequantize("token_embd.weight")[ids])
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(0))
    got = ops.quant_linear(x, layer, None).double()
    want = emulated_linear(x, layer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    h = torch.randn(2, 576, generator=torch.Generator().manual_seed(1))  # the tied LM head
    logits = ops.quant_linear(h, embed[:4096].contiguous(), None).double()
    want = emulated_linear(h, embed[:4096].contiguous())
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_input_checks() -> None:
    fmt = PACKED_FORMATS[Q.Q8_0]
    w = random_blocks(fmt, 8, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        ops.quant_linear(torch.randn(2, 32), w, None)
    with pytest.raises(RuntimeError, match="no ggml format has 19-byte blocks"):
        ops.quant_linear(x, torch.zeros(8, 2, 19, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="contiguous uint8 CPU tensor"):
        ops.quant_linear(x, w.float(), None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.quant_linear(x.double(), w, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.quant_linear(x, w, torch.zeros(7))
    with pytest.raises(RuntimeError, match="id 8 outside"):
        ops.quant_embedding(torch.tensor([8]), w)
    with pytest.raises(RuntimeError, match="is not -1"):
        ops.set_quant_isa(7)
    with pytest.raises(ValueError, match="TAILSERVE_QUANT_ISA='sse'"):
        set_quant_isa("sse")
    assert ops.quant_linear(torch.zeros(0, 64), w, None).shape == (0, 8)
