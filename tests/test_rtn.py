"""``--quantization int8|int4``: group-wise round-to-nearest of a float checkpoint at load, served
by the packed GGUF kernels; the byte count the runner and ``tailserve plan`` share.

Quality, on the bundled model written as a bf16 Hugging Face folder (the loader's float32
dequantization of the GGUF, rounded to bf16), over the 301 tokens of tests/data/perplexity.txt,
against the plain PyTorch model on that bf16 checkpoint widened to float32 (measured on this
machine: perplexity 31.05):

    int8 (Q8_0)  perplexity 31.65 (+1.9%), largest logit difference 1.19, argmax 96.3%
    int4 (Q4_1)  perplexity 31.02 (-0.1%), largest logit difference 1.29, argmax 97.0%

Both include the kernels' int8 activations (tests/test_gguf_packed.py: about 1 logit alone).
The int4 figure flatters: this checkpoint's layers come from a Q4_1 file, so their values sit
on a Q4_1 grid already and RTN Q4_1 nearly restores them (Q4_0 RTN of the same checkpoint:
perplexity 34.2, argmax 66%). The bounds: perplexity within 5%, logits within 2.5, argmax 93%.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import gguf
import pytest
import torch

from tailserve import LLM
from tailserve.analyze.plan import PlanInputs, load_config, make_plan
from tailserve.cli import main
from tailserve.config import EngineArgs
from tailserve.errors import ConfigError, ModelLoadError
from tailserve.model.device import detect_platform
from tailserve.model.loader import LoadedModel, check_quantization_supported, load_model
from tailserve.model.quant.formats import dequantize_reference, format_of, is_packed
from tailserve.model.transforms.gguf_linear import GGUFEmbedding, GGUFLinear
from tailserve.model.transforms.rtn import quantize_rtn
from tailserve.model.weight_storage import bytes_by_format, planned_storage
from test_dtypes16 import eager_and_graph, greedy
from test_gguf_packed import TEXT, make_runner, perplexity, reference_logits, runner_logits

pytestmark = pytest.mark.usefixtures("cpu_kernels")
PERPLEXITY_RTOL = 0.05
MAX_LOGIT_DIFF = 2.5
MIN_ARGMAX = 0.93


# --- the quantizer -----------------------------------------------------------------------------


def test_groups_of_32_are_ggmls_own_quantization(default_loaded: LoadedModel) -> None:
    """At group 32 the blocks are byte for byte what gguf's reference quantizer writes, on
    real weights and on random ones with an odd row count."""
    real = default_loaded.weights["model.layers.3.mlp.down_proj.weight"][:40]
    rand = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * 0.02
    for x in (real, rand):
        for fmt in ("Q8_0", "Q4_1", "Q4_0"):
            got = quantize_rtn(x.to(torch.bfloat16), fmt)
            ref = gguf.quantize(x.to(torch.bfloat16).float().numpy(),
                                gguf.GGMLQuantizationType[fmt])
            assert format_of(got).name == fmt
            assert torch.equal(got, torch.from_numpy(ref).view(got.shape)), fmt


def test_a_group_of_several_blocks_shares_one_scale() -> None:
    """A group over 32 values: each of its 32-value blocks repeats the group's scale, and the
    values are the group-wise round-to-nearest's (worked here in float64)."""
    x = torch.randn(6, 192, generator=torch.Generator().manual_seed(1)).double()
    for group in (64, 96, -1):
        g = x.view(6, -1, 192 if group == -1 else group)
        # Q8_0: d = max|x| / 127, q = round half away from zero
        d = g.abs().amax(-1, keepdim=True) / 127
        q = ((g / d).abs() + 0.5).floor() * (g / d).sign()
        expect8 = (q * d.half().double()).view(6, 192)
        packed = quantize_rtn(x.float(), "Q8_0", group)
        scales = packed[..., :2].contiguous().view(torch.float16).view(6, g.shape[1], -1)
        assert (scales == scales[..., :1]).all()
        assert torch.allclose(dequantize_reference(packed).double(), expect8, atol=1e-6)
        # Q4_1: m = min, d = (max - min) / 15
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d4 = (hi - lo) / 15
        q4 = ((g - lo) / d4 + 0.5).floor().clamp(0, 15)
        expect4 = (q4 * d4.half().double() + lo.half().double()).view(6, 192)
        got4 = dequantize_reference(quantize_rtn(x.float(), "Q4_1", group)).double()
        assert torch.allclose(got4, expect4, atol=1e-6)
    # The same bytes as groups of 32, and more error: a larger group buys nothing but range.
    err = {g: (dequantize_reference(quantize_rtn(x.float(), "Q4_1", g)) - x.float()).norm()
           for g in (32, 192)}
    assert quantize_rtn(x.float(), "Q4_1", 192).shape == quantize_rtn(x.float(), "Q4_1").shape
    assert err[32] < err[192]


def test_bad_input_is_a_start_up_error_with_the_numbers(default_bf16_folder: str) -> None:
    with pytest.raises(ModelLoadError, match="is a GGUF, quantized already"):
        load_model(None, quantization="int8")
    with pytest.raises(ConfigError, match=r"multiple of 32 .* got 48"):
        EngineArgs(quantization="int4", quantization_group_size=48)
    with pytest.raises(ConfigError, match="must be int8 or int4, got 'int3'"):
        EngineArgs(quantization=typing.cast(Any, "int3"))
    with pytest.raises(ConfigError, match="rows of 576 values, not a multiple of 128"):
        load_model(default_bf16_folder, quantization="int4", quantization_group_size=128)
    with pytest.raises(ConfigError, match="--dtype bfloat16 cannot go with it"):
        EngineArgs(quantization="int8", dtype="bfloat16")
    with pytest.raises(ModelLoadError, match=r"needs the compiled CPU kernels .* cuda"):
        check_quantization_supported("int8", "cuda", "bfloat16")
    # dtype auto on a bf16 checkpoint: float32 beside the blocks, as the kernels compute.
    runner = EngineArgs(quantization="int4").resolve_runner(detect_platform(), "bfloat16")
    assert (runner.device, runner.dtype) == ("cpu", "float32")


# --- the bundled model as a bf16 checkpoint ------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_loaded(default_bf16_folder: str) -> LoadedModel:
    return load_model(default_bf16_folder)


@pytest.fixture(scope="module")
def quantized(default_bf16_folder: str) -> dict[str, LLM]:
    """An engine per scheme over the bf16 checkpoint quantized at load."""
    return {q: LLM.from_loaded(load_model(default_bf16_folder, quantization=q),
                               quantization=q, kv_cache_memory=0.1, max_model_len=512)
            for q in ("int8", "int4")}


def test_int8_and_int4_against_the_bf16_checkpoint(
    default_bf16_folder: str, bf16_loaded: LoadedModel, quantized: dict[str, LLM]
) -> None:
    ids = bf16_loaded.tokenizer(TEXT.read_text())["input_ids"]
    ref = reference_logits(bf16_loaded, ids)
    ppl_ref = perplexity(ref, ids)
    cfg, _, _ = load_config(default_bf16_folder)
    for q, llm in quantized.items():
        loaded, runner = llm.engine.loaded, llm.engine.runner
        assert runner.config.dtype == "float32"
        assert type(runner.model.embed_tokens) is GGUFEmbedding  # the head reads its blocks
        assert type(runner.model.layers[0].mlp.down_proj) is GGUFLinear
        packed = {format_of(t).name for t in loaded.weights.values() if is_packed(t)}
        assert packed == ({"Q8_0"} if q == "int8" else {"Q8_0", "Q4_1"})
        got = runner_logits(runner, ids)
        ppl = perplexity(got, ids)
        assert abs(ppl / ppl_ref - 1) < PERPLEXITY_RTOL, (q, ppl, ppl_ref)
        assert (got - ref).abs().max().item() < MAX_LOGIT_DIFF, q
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > MIN_ARGMAX, q
        # What the runner holds is what `plan` counts, format by format.
        plan = make_plan(cfg, PlanInputs(quantization=q))
        assert runner.weight_bytes == plan.weight_bytes_by_format, q
    # int4: the layers' Q4_1 blocks are the GGUF's size exactly; the Q8_0 table the GGUF's too.
    assert make_plan(cfg, PlanInputs(quantization="int4")).weight_bytes_by_format == {
        "Q4_1": 66_355_200, "Q8_0": 30_081_024, "float32": 140_544}


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_one_call_decode_and_module_forward_give_the_same_tokens(
    quantized: dict[str, LLM], q: str
) -> None:
    graph, eager = eager_and_graph(quantized[q], lambda m: greedy(m, 12))
    assert graph == eager


def test_serve_flags_on_a_float32_checkpoint_with_an_untied_head(tiny_model_dir: str) -> None:
    """--quantization int4 --quantization-group-size 64 end to end (EngineCore.from_args), on
    the tiny float32 model: its untied LM head is Q8_0 of its own."""
    llm = LLM(model=tiny_model_dir, quantization="int4", quantization_group_size=64,
              kv_cache_memory=0.05, max_model_len=256)
    assert llm.engine.loaded.weights == {}  # released: the runner holds the blocks it serves
    model = llm.engine.runner.model
    assert type(model.lm_head) is GGUFLinear
    assert format_of(typing.cast(GGUFLinear, model.lm_head).part0).name == "Q8_0"
    down = typing.cast(GGUFLinear, model.layers[0].mlp.down_proj)
    assert format_of(down.part0).name == "Q4_1"
    cfg, _, _ = load_config(tiny_model_dir)
    assert llm.engine.runner.weight_bytes == make_plan(
        cfg, PlanInputs(quantization="int4", quantization_group_size=64)).weight_bytes_by_format
    graph, eager = eager_and_graph(llm, lambda m: greedy(m, 8))
    assert graph == eager


def test_plan_counts_every_format_as_the_runner_does(
    default_bf16_folder: str, bf16_loaded: LoadedModel, capsys: pytest.CaptureFixture[str],
) -> None:
    # The bundled GGUF, --dtype auto: its blocks as the CPU loader keeps them.
    packed = load_model(None, gguf_weights="packed")
    cfg, path, file_bytes = load_config(None)
    gguf_plan = make_plan(cfg, PlanInputs(dtype="auto"), path, file_bytes)
    assert gguf_plan.weight_bytes_by_format == make_runner(packed.config,
                                                           packed.weights).weight_bytes
    # The bf16 checkpoint as stored; the CPU runner computes in float32, so its norms are
    # float32 (planned_storage's compute_dtype; plan's default device computes in bf16).
    runner = make_runner(bf16_loaded.config, bf16_loaded.weights, dtype="auto")
    assert (runner.config.dtype, runner.config.compute_dtype) == ("bfloat16", "float32")
    assert bytes_by_format(planned_storage(cfg, dtype="bfloat16", compute_dtype="float32")) \
        == runner.weight_bytes
    # The CLI: --quantization (EngineArgs' help), and a group size that does not divide.
    assert main(["plan", default_bf16_folder, "--quantization", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes_by_format"] == {"Q8_0": 142_884_864, "float32": 140_544}
    assert out["inputs"]["dtype"] == "int8"
    assert main(["plan", default_bf16_folder, "--quantization", "int4",
                 "--quantization-group-size", "128"]) == 2
    assert "not a multiple of 128" in capsys.readouterr().err
