"""GGUF weights served as stored: the packed loader, the module swap, the one-call decode, and
quality against the float32-dequantized reference of the same file.

Tolerances (stated; measured on this machine, with margin): the packed path quantizes
activations to int8 per block of 32 (as llama.cpp does), so its logits differ from the float32
reference of the same file (the plain PyTorch model on the dequantized weights). On the bundled
model over the 301 tokens of tests/data/perplexity.txt: largest logit difference 1.08 (logits
span -34..36), argmax agreement 98.3%, perplexity 30.95 vs 31.06 (-0.36%). The tests allow a
logit difference of 2.0, 95% argmax agreement and 1% perplexity. (The float32 kernels on the
same dequantized weights are within 1e-4 of the plain model: the difference is the int8
activations, not the blocks, which the kernels read exactly: test_quant_kernels.py.)
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from server_util import metric_value
from tailserve import LLM, SamplingParams
from tailserve.config import EngineArgs
from tailserve.engine.loop import EngineLoop
from tailserve.errors import ConfigError, ModelLoadError
from tailserve.kernels import set_quant_isa
from tailserve.model.attention import AttentionMetadata
from tailserve.model.attention.torch_ref import TorchAttentionBackend
from tailserve.model.device import detect_platform
from tailserve.model.gguf import gguf_model_config, load_gguf_weights, read_gguf
from tailserve.model.llama import LlamaForCausalLM
from tailserve.model.loader import LoadedModel, load_model, resolve_gguf_weights
from tailserve.model.meta_build import materialize_model
from tailserve.model.quant.formats import (
    PACKED_FORMATS,
    dequantize_reference,
    format_of,
    is_packed,
    is_tiled,
    untile_blocks,
)
from tailserve.model.runner import ModelRunner
from tailserve.model.transforms.gguf_linear import GGUFEmbedding, GGUFLinear
from tailserve.obs.metrics import ServerMetrics
from test_cpu_decode import assert_graph_matches_module_forward, decode_batch, mixed_batch
from test_quant_kernels import random_blocks

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs
Q = gguf.GGMLQuantizationType
TEXT = Path(__file__).parent / "data" / "perplexity.txt"
MAX_LOGIT_DIFF = 2.0
PERPLEXITY_RTOL = 0.01
TINY_RTOL = 0.08  # random 2-layer models, relative (Frobenius) difference to the reference


@pytest.fixture(scope="module")
def packed_loaded() -> LoadedModel:
    return load_model(None, gguf_weights="packed")


def make_runner(config: Any, weights: dict[str, torch.Tensor], **args: Any) -> ModelRunner:
    engine = EngineArgs(**{"device": "cpu", "dtype": "float32", "num_kv_blocks": 64,
                           "max_model_len": 512, **args}).resolve(config, detect_platform())
    runner = ModelRunner(engine.model, engine.runner, engine.scheduler.max_model_len,
                         dict(weights))
    runner.allocate_kv_cache(engine.cache)
    return runner


def prefill_logits(model: LlamaForCausalLM, backend: Any, ids: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill of ``ids`` into a fresh KV pool."""
    n, bs = len(ids), 16
    cfg = model.config
    num_blocks = -(-n // bs)
    pools = [torch.zeros(2, num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim)
             for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(
        num_decodes=0, slot_mapping=torch.arange(n), query_start_loc=[0, n], query_lens=[n],
        seq_lens_list=[n], seq_lens=torch.tensor([n]),
        block_tables=torch.arange(num_blocks).view(1, -1), block_size=bs,
        scale=cfg.head_dim ** -0.5,
    )
    with torch.inference_mode():
        backend.begin_step(meta)
        hidden = model(torch.tensor(ids), torch.arange(n), pools, meta)
        return model.compute_logits(hidden)


def runner_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return prefill_logits(runner.model, runner.backend, ids)


def reference_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The float32 weights in the plain PyTorch model (no kernels, no transforms): the
    reference every fast path is held to."""
    backend = TorchAttentionBackend()
    with torch.device("meta"):
        model = LlamaForCausalLM(loaded.config, backend, max_position=len(ids))
    materialize_model(model, torch.device("cpu"), len(ids))
    model.load_weights(loaded.weights)
    return prefill_logits(model.eval(), backend, ids)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).mean().item()
    return math.exp(nll)


# --- the bundled file --------------------------------------------------------------------------


def test_packed_weights_are_the_files_blocks(
    packed_loaded: LoadedModel, default_loaded: LoadedModel
) -> None:
    f = read_gguf(packed_loaded.source)
    packed = {n: t for n, t in packed_loaded.weights.items() if is_packed(t)}
    # Every matrix (7 per layer and the tied embedding) is kept as its blocks.
    assert len(packed) == 7 * packed_loaded.config.num_hidden_layers + 1
    assert {format_of(t).name for t in packed.values()} == {"Q4_1", "Q8_0"}
    file_bytes = sum(i.nbytes for i in f.tensors.values() if len(i.shape) == 2)
    assert sum(t.numel() for t in packed.values()) == file_bytes
    # The same values as the reference path, Q/K rows un-permuted alike.
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.up_proj.weight"):
        assert torch.equal(dequantize_reference(packed[name]), default_loaded.weights[name])


def test_logits_and_perplexity_against_the_dequantized_reference(
    packed_loaded: LoadedModel, default_loaded: LoadedModel
) -> None:
    ids = packed_loaded.tokenizer(TEXT.read_text())["input_ids"]
    assert 250 < len(ids) < 400
    ref = reference_logits(default_loaded, ids)
    runner = make_runner(packed_loaded.config, packed_loaded.weights)
    assert runner.weight_bytes.keys() == {"Q4_1", "Q8_0", "float32"}
    assert type(runner.model.embed_tokens) is GGUFEmbedding
    assert type(runner.model.lm_head) is GGUFLinear
    got = runner_logits(runner, ids)
    assert (got - ref).abs().max().item() < MAX_LOGIT_DIFF
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.95
    ppl, ppl_ref = perplexity(got, ids), perplexity(ref, ids)
    assert abs(ppl / ppl_ref - 1) < PERPLEXITY_RTOL, (ppl, ppl_ref)


def test_the_runner_serves_tiles_that_share_the_dicts_bytes(packed_loaded: LoadedModel) -> None:
    weights = dict(packed_loaded.weights)
    engine = EngineArgs(device="cpu", dtype="float32", num_kv_blocks=64,
                        max_model_len=512).resolve(packed_loaded.config, detect_platform())
    runner = ModelRunner(engine.model, engine.runner, engine.scheduler.max_model_len, weights)
    model = runner.model
    tensors = [p for m in model.modules() if isinstance(m, GGUFLinear) for p in m.parts]
    assert all(is_tiled(t) for t in tensors)  # Q4_1 / Q8_0, every row count a multiple of 16
    assert model.lm_head.part0 is model.embed_tokens.table  # the tied table, once
    # The dict's entries are the modules' bytes (views of the fused tiles), the file's bytes.
    q = "model.layers.0.self_attn.q_proj.weight"
    qkv = typing.cast(GGUFLinear, model.layers[0].self_attn.qkv_proj).part0
    assert weights[q].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert torch.equal(untile_blocks(weights[q]), packed_loaded.weights[q])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in weights.values() if is_packed(t)}
    file_bytes = sum(t.numel() for t in packed_loaded.weights.values() if is_packed(t))
    assert sum(storages.values()) == file_bytes
    assert runner.weight_bytes["Q4_1"] + runner.weight_bytes["Q8_0"] == file_bytes


def test_one_call_decode_and_module_forward_give_the_same_tokens(
    packed_loaded: LoadedModel,
) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = []
    for eager in (True, False):
        llm = LLM.from_loaded(packed_loaded, dtype="float32", kv_cache_memory=0.5,
                              enforce_eager=eager)
        assert (llm.engine.runner.decode_graph is None) == eager
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
    assert tokens[0] == tokens[1]
    # The resident bytes reach /metrics through the engine's Ready message.
    ready = EngineLoop.ready_message(typing.cast(Any, SimpleNamespace(core=llm.engine)))
    assert ready.weight_bytes == llm.engine.runner.weight_bytes
    metrics = ServerMetrics()
    metrics.on_weights(ready.weight_bytes)
    text = metrics.render()[0].decode()
    q4 = metric_value(text, "tailserve:model_weight_bytes", {"format": "Q4_1"})
    q8 = metric_value(text, "tailserve:model_weight_bytes", {"format": "Q8_0"})
    assert (q4, q8) == (66_355_200, 30_081_024)  # the file's blocks, byte for byte


def test_mixed_steps_on_the_bundled_gguf_match_the_module_forward(
    packed_loaded: LoadedModel,
) -> None:
    """Decodes and prefill chunks in one call on the real packed weights, bit-identical to the
    module forward, at any token count (quant_linear serves every row count in both)."""
    runner = make_runner(packed_loaded.config, packed_loaded.weights, num_kv_blocks=128)
    graph = runner.decode_graph
    assert graph is not None and graph.max_tokens is None
    # 4 decodes + a first chunk + one deep in a prompt: 4 + 33 + 101 = 138 tokens, more
    # than float32 panels would run here (PANEL_MAX_ROWS).
    ids, positions, meta = mixed_batch(runner, [64, 200, 9, 130], [(0, 33), (150, 101)], seed=3)
    assert_graph_matches_module_forward(runner, ids, positions, meta)
    ids, positions, meta = mixed_batch(runner, [31], [(77, 5)], seed=4)
    assert_graph_matches_module_forward(runner, ids, positions, meta)


def test_gguf_weights_choice() -> None:
    assert resolve_gguf_weights("auto", "cpu", "float32") == "packed"
    assert resolve_gguf_weights("auto", "cpu", "bfloat16") == "dequantize"
    assert resolve_gguf_weights("auto", "cuda", "float32") == "dequantize"
    assert resolve_gguf_weights("dequantize", "cpu", "float32") == "dequantize"
    with pytest.raises(ModelLoadError, match="runs bfloat16 on cpu"):
        resolve_gguf_weights("packed", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        resolve_gguf_weights("int4", "cpu", "float32")


def test_packed_weights_refused_where_no_kernel_reads_them(packed_loaded: LoadedModel) -> None:
    engine = EngineArgs(device="cpu", dtype="bfloat16", num_kv_blocks=64,
                        max_model_len=512).resolve(packed_loaded.config, detect_platform())
    with pytest.raises(ConfigError, match="only the compiled CPU kernels read"):
        ModelRunner(engine.model, engine.runner, 512, dict(packed_loaded.weights))


# --- small GGUF files in every format ------------------------------------------------------------


def write_gguf(path: Path, qtype: Any, *, hidden: int, inter: int, arch: str = "llama",
               odd: dict[str, Any] | None = None, seed: int = 0, context: int = 512) -> str:
    """A random 2-layer model; matrices in ``qtype`` (``odd``: GGUF name -> another type),
    quantized by ``gguf`` where it can, else random blocks of that format."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, vocab = 4, 2, 320
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
              "output_norm.weight": (hidden,)}
    for i in range(2):
        b = f"blk.{i}."
        shapes |= {b + "attn_q.weight": (hidden, hidden),
                   b + "attn_k.weight": (kv_heads * head_dim, hidden),
                   b + "attn_v.weight": (kv_heads * head_dim, hidden),
                   b + "attn_output.weight": (hidden, hidden),
                   b + "ffn_gate.weight": (inter, hidden), b + "ffn_up.weight": (inter, hidden),
                   b + "ffn_down.weight": (hidden, inter),
                   b + "attn_norm.weight": (hidden,), b + "ffn_norm.weight": (hidden,)}
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": (hidden,), b + "attn_k.bias": (kv_heads * head_dim,),
                       b + "attn_v.bias": (kv_heads * head_dim,)}
    for n, (name, shape) in enumerate(shapes.items()):
        if len(shape) == 1:
            scale = 0.1 if name.endswith(".bias") else 1.0
            base = 0.0 if name.endswith(".bias") else 1.0
            values = base + scale * torch.rand(shape, generator=g) - scale / 2
            writer.add_tensor(name, values.numpy().astype(np.float32))
            continue
        t = (odd or {}).get(name, qtype)
        if t in PACKED_FORMATS and t not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            data = gguf.quantize((torch.randn(shape, generator=g) * 0.05).numpy(), t)
        elif t in PACKED_FORMATS:
            data = random_blocks(PACKED_FORMATS[t], *shape, seed=seed * 100 + n).reshape(
                shape[0], -1).numpy()
        else:  # a type the kernels do not read: random blocks, only fp16 d at byte 0 fixed
            block, size = gguf.GGML_QUANT_SIZES[t]
            raw = np.random.default_rng(n).integers(0, 256, (shape[0], shape[1] // block, size),
                                                    dtype=np.uint8)
            raw[:, :, :2] = np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(
                *raw.shape[:2], 2)
            data = raw.reshape(shape[0], -1)
        writer.add_tensor(name, data, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def tiny(path: str, packed: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    f = read_gguf(path)
    config = gguf_model_config(f)
    return config, load_gguf_weights(f, config, packed=packed)


FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_every_format_one_call_decode_matches_module_forward(tmp_path: Path, qtype: Any) -> None:
    k_quant = qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
    arch = "qwen2" if qtype == Q.Q8_0 else "llama"  # qkv bias once
    path = write_gguf(tmp_path / "m.gguf", qtype, hidden=256 if k_quant else 64,
                      inter=512 if k_quant else 96, arch=arch)
    config, weights = tiny(path, packed=True)
    runner = make_runner(config, weights)
    assert type(runner.model.layers[1].mlp.down_proj) is GGUFLinear
    graph = runner.decode_graph
    assert graph is not None
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    pools = runner.kv_cache.clone()
    ids, positions, meta = decode_batch(runner, [1, 40, 17], seed=1)
    with torch.inference_mode():
        want = runner.model(ids, positions, runner.kv_caches, meta)
        got = graph(ids, positions, list(pools.unbind(0)), meta)
    assert torch.equal(got, want)
    assert torch.equal(pools, runner.kv_cache)
    # A mixed step of more tokens than float32 panels run here: quant_linear at any rows.
    assert graph.max_tokens is None
    assert_graph_matches_module_forward(
        runner, *mixed_batch(runner, [1, 40, 17], [(23, 150)], seed=2))
    # The same model dequantized: the packed forward is within the activation-quantization
    # error of it (random weights compound it faster than trained ones: 1-4% measured).
    ref_config, ref_weights = tiny(path, packed=False)
    ref_runner = make_runner(ref_config, ref_weights)
    ref_runner.kv_cache.copy_(pools)
    with torch.inference_mode():
        ref = ref_runner.model(ids, positions, ref_runner.kv_caches, meta)
    assert ((want - ref).norm() / ref.norm()).item() < TINY_RTOL


@pytest.fixture(params=["avx2", "avx512vnni", "amx", "amx-bf16"])
def product_isa(cpu_kernels: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """The products' levels, forced as TAILSERVE_QUANT_ISA would; those this CPU lacks skip."""
    try:
        set_quant_isa(request.param)
    except RuntimeError as e:
        pytest.skip(f"{request.param} does not run here: {e}")
    yield request.param
    set_quant_isa("auto")


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K], ids=["Q4_1", "Q8_0", "Q4_K"])
def test_a_step_of_many_rows_matches_module_forward(tmp_path: Path, product_isa: str,
                                                    qtype: Any) -> None:
    """A step past decode_layers' row-blocked MLP threshold (960 rows: the gate/up product and
    SiLU 128 rows at a time) gives the module forward's numbers (one product of every row)
    bit for bit, with a ragged last block (T mod 16 != 0: rows the tile kernels leave to the
    vector passes) and decodes first."""
    k_quant = qtype == Q.Q4_K
    path = write_gguf(tmp_path / "m.gguf", qtype, hidden=256 if k_quant else 64,
                      inter=512 if k_quant else 96, context=2048)
    config, weights = tiny(path, packed=True)
    runner = make_runner(config, weights, num_kv_blocks=400, max_model_len=1536)
    assert_graph_matches_module_forward(
        runner, *mixed_batch(runner, [1, 40, 17], [(5, 1100), (0, 30)], seed=3))
    # 1,030 rows = 8 x 128 + 6: the last block takes those 6 rows with it; alone in a call
    # they would go to the K-quants' few-row kernels, whose bits differ.
    assert_graph_matches_module_forward(
        runner, *mixed_batch(runner, [1, 40, 17], [(5, 1027)], seed=4))


def test_mixed_formats_and_an_unsupported_type(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Q4_K_M-like file: some v / down matrices in Q6_K, and one IQ4_NL matrix, which the
    kernels do not read and the loader dequantizes with a warning naming it."""
    odd = {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K,
           "blk.1.attn_output.weight": Q.IQ4_NL}
    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, hidden=256, inter=512, odd=odd)
    with caplog.at_level(logging.WARNING, logger="tailserve.model.gguf"):
        config, weights = tiny(path, packed=True)
    assert "blk.1.attn_output.weight (IQ4_NL)" in caplog.text
    assert weights["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float32
    runner = make_runner(config, weights)
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    assert [format_of(p).name for p in qkv.parts] == ["Q4_K", "Q6_K"]  # q+k fused, v apart
    assert runner.decode_graph is None  # mixed formats: the module forward runs decodes
    ref_config, ref_weights = tiny(path, packed=False)
    ids = list(range(3, 40))
    got = runner_logits(runner, ids)
    ref = reference_logits(LoadedModel(ref_config, ref_weights, None, path), ids)
    assert ((got - ref).norm() / ref.norm()).item() < TINY_RTOL
