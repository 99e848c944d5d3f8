"""Qwen3, Phi-3 and a windowed Mistral as GGUF files (issue 32, item 4, the GGUF side): a tiny
random checkpoint built from its transformers config class, written as llama.cpp's converter
writes it (its names from the ``gguf`` package's own tensor-name map, its metadata keys, q and k
permuted only for ``llama``), quantized, read by tailserve: greedy tokens equal transformers' on
the same dequantized weights for 64 tokens, with chunked prefill, a prefix-cache hit and a
preemption. Bad files are refused from the header, in one line naming file, tensor and
expectation, before a tensor is read.

The layout each architecture stores was read from llama.cpp's ``convert_hf_to_gguf.py``:
``LlamaModel`` permutes q/k rows for GGML's interleaved rope; ``Qwen2Model`` (and ``Qwen3Model``,
its subclass) and ``Phi3MiniModel`` store Hugging Face's rows. ``test_qwen3_q_k_are_not_permuted``
shows the parity test tells the two layouts apart.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tailserve import LLM, SamplingParams
from tailserve.errors import ModelLoadError
from tailserve.model.gguf import (
    GGUFFile,
    gguf_model_config,
    load_gguf_weights,
    packed_storage,
    read_gguf,
)
from tailserve.model.loader import default_model_path, load_model
from tailserve.model.quant.formats import dequantize_reference, is_packed
from tailserve.model.tokenizer import load_gguf_tokenizer
from tailserve.model.transforms.gguf_linear import GGUFLinear
from test_cpu_decode import decode_batch
from test_engine_parity import hf_greedy, ts_greedy
from test_gguf_packed import TINY_RTOL, make_runner
from tiny_models import build_tiny_llama, build_tiny_mistral, build_tiny_phi3, build_tiny_qwen3

Q = gguf.GGMLQuantizationType
NEW_TOKENS = 64
ARCHS = {"Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
         "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA, "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA}


def prompts_for(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(20, 49152, (n,), generator=g).tolist() for n in lengths]


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute of q / k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


@functools.cache
def _vocabulary() -> tuple[list[str], list[str]]:
    """The bundled SmolLM2 tokenizer's tokens (by id) and merges, which the tiny checkpoints
    share: a GGUF carries its vocabulary."""
    tok = load_gguf_tokenizer(default_model_path())
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_gguf(path: Path, hf: Any, qtype: Any, *, permute: bool | None = None,
               drop: tuple[str, ...] = (), replace: dict[str, torch.Tensor] | None = None,
               metadata: dict[str, Any] | None = None,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """``hf`` (a transformers model) as llama.cpp writes it, 2-D tensors in ``qtype`` (1-D in
    F32, as llama.cpp keeps them); returns the state dict as the file holds it, dequantized
    (transformers' reference weights). ``permute`` (default: for ``llama``) q / k rows;
    ``drop`` / ``replace``: GGUF tensors left out / written instead (bad files); ``metadata``:
    more keys (name -> (value, type)); ``extra``: more tensors."""
    c = hf.config
    arch = ARCHS[c.architectures[0]]
    name = gguf.MODEL_ARCH_NAMES[arch]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta")
                              else c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == gguf.MODEL_ARCH.QWEN3:  # TextModel writes head_dim where config.json has it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.PHI3:  # Phi3MiniModel writes the window always, 0 for none
        writer.add_sliding_window(c.sliding_window or 0)
    elif getattr(c, "sliding_window", None) is not None:  # a converter that writes Mistral's window
        writer.add_sliding_window(c.sliding_window)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])
    tokens, merges = _vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    permute = arch == gguf.MODEL_ARCH.LLAMA if permute is None else permute
    held = {}
    for hf_name, tensor in hf.state_dict().items():
        stem, _, kind = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(stem)}.{kind}"
        if gguf_name in drop:
            continue
        data = (replace or {}).get(gguf_name, tensor).float()
        stored = data
        if permute and ".q_proj." in hf_name:
            stored = llamacpp_permute(data, c.num_attention_heads)
        elif permute and ".k_proj." in hf_name:
            stored = llamacpp_permute(data, c.num_key_value_heads)
        # Quantization is per row, so it commutes with the permutation of rows: the reference
        # takes the rows in Hugging Face's order, rounded as the file's are.
        if data.dim() == 2 and qtype in (Q.Q8_0, Q.Q4_0):
            writer.add_tensor(gguf_name, gguf.quantize(stored.numpy(), qtype), raw_dtype=qtype)
            values = gguf.dequantize(gguf.quantize(data.numpy(), qtype), qtype)
        elif data.dim() == 2 and qtype == Q.F16:
            writer.add_tensor(gguf_name, stored.numpy().astype(np.float16))
            values = data.numpy().astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name, stored.numpy())
            values = data.numpy()
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(values)).reshape(data.shape)
    for gguf_name, array in (extra or {}).items():
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def build(builder: Any, tmp_path: Path, qtype: Any, **overrides: Any) -> tuple[str, Any]:
    """A GGUF of ``builder``'s tiny checkpoint, and transformers on the file's weights."""
    folder = builder(tmp_path / "hf", max_position_embeddings=2048, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = tmp_path / "m.gguf"
    hf.load_state_dict(write_gguf(path, hf, qtype), strict=True)
    return str(path), hf


def served(path: str, **engine_args: Any) -> LLM:
    """``path`` loaded by tailserve (the tokenizer: the bundled one, the same vocabulary, which
    spares transformers' ~5 s GGUF vocabulary reader per file)."""
    loaded = load_model(path, with_tokenizer=False)
    loaded = dataclasses.replace(loaded, tokenizer=load_gguf_tokenizer(default_model_path()))
    return LLM.from_loaded(loaded, dtype="float32", gguf_weights="dequantize", **engine_args)
@pytest.mark.parametrize("builder,qtype,overrides", [
    (build_tiny_qwen3, Q.Q8_0, {}),
    (build_tiny_phi3, Q.Q4_0, {"sliding_window": 8}),
    (build_tiny_mistral, Q.F16, {"sliding_window": 8}),
], ids=["qwen3-Q8_0", "phi3-window-8-Q4_0", "mistral-window-8-F16"])
def test_gguf_family_matches_transformers(tmp_path: Path, builder: Any, qtype: Any,
                                          overrides: dict[str, Any]) -> None:
    path, hf = build(builder, tmp_path, qtype, **overrides)
    prompts = prompts_for([5, 40, 300])
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    # Chunked prefill (a 64-token budget: the 300-token prompt over five steps), steps sized by
    # the budget alone (test_families.py says why).
    llm = served(path, num_kv_blocks=200, max_num_batched_tokens=64, slo_itl_ms=None,
                 scheduling_policy="fcfs")
    assert llm.engine.config.model.sliding_window == overrides.get("sliding_window")
    assert ts_greedy(llm, prompts, NEW_TOKENS) == want
    # A prefix-cache hit: the same prompts again start from their cached blocks.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == want
    assert again[2].num_cached_tokens >= 288
    # Preemption: a pool too small for all three at once recomputes one; answers unchanged.
    # Where every layer slides (window 8) a request holds at most ~6 blocks (its window and a
    # 64-token chunk), so 24 would fit all three: 8 (7 usable beside the null block) does not.
    small = served(path, num_kv_blocks=8 if overrides.get("sliding_window") else 24,
                   max_num_batched_tokens=64,
                   max_model_len=306 + NEW_TOKENS, enable_prefix_caching=False,
                   slo_itl_ms=None, scheduling_policy="fcfs")
    assert ts_greedy(small, prompts, NEW_TOKENS) == want
    assert small.engine.scheduler.num_preemptions_total > 0


# Llama 3.1's rope scaling, with a pre-training context small enough that the tiny model's
# 8 rotation frequencies fall in all three bands (kept, blended, stretched 8x).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def test_llama31_rope_freqs_match_transformers_llama3_scaling(tmp_path: Path) -> None:
    """llama.cpp's converter writes Llama 3.1's rope scaling as ``rope_freqs.weight``: per
    rotation frequency, the divisor that turns the plain frequency into the scaled one (and
    no scaling metadata). tailserve divides by it, as llama.cpp does; greedy tokens equal
    transformers' with the llama3 rope_scaling dict, prompts past the 32-token context."""
    folder = build_tiny_llama(tmp_path / "hf", max_position_embeddings=2048,
                              rope_scaling=LLAMA3_ROPE)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # transformers' own scaled frequencies, against the plain ones of the same base.
    scaled = hf.model.rotary_emb.inv_freq.float()
    c = hf.config
    theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    dim = c.hidden_size // c.num_attention_heads
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    factors = (plain / scaled).numpy().astype(np.float32)
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(8.0)
    assert ((factors > 1.01) & (factors < 7.99)).any()  # the blended band too
    path = tmp_path / "l31.gguf"
    hf.load_state_dict(write_gguf(path, hf, Q.Q8_0, extra={"rope_freqs.weight": factors}),
                       strict=True)
    f = read_gguf(str(path))
    cfg = gguf_model_config(f)
    assert cfg.rope_scaling == {"rope_type": "freq_factors",
                                "freq_factors": [float(x) for x in factors]}
    assert "rope_freqs.weight" not in load_gguf_weights(f, cfg)
    prompts = prompts_for([5, 40, 300])
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    llm = served(str(path), num_kv_blocks=200, max_num_batched_tokens=64, slo_itl_ms=None,
                 scheduling_policy="fcfs")
    assert ts_greedy(llm, prompts, NEW_TOKENS) == want
    # Without the factors the same weights are another model past the short context.
    plain_path = tmp_path / "plain.gguf"
    write_gguf(plain_path, hf, Q.Q8_0)
    other = served(str(plain_path), num_kv_blocks=200, max_num_batched_tokens=64,
                   slo_itl_ms=None, scheduling_policy="fcfs")
    assert ts_greedy(other, prompts, NEW_TOKENS) != want


def test_qwen3_q_k_are_not_permuted(tmp_path: Path) -> None:
    """The same Qwen3 written with llama's q/k permutation is another model to tailserve (as
    to llama.cpp, whose qwen3 rope reads Hugging Face's rows): the parity above can tell."""
    folder = build_tiny_qwen3(tmp_path / "hf", max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    write_gguf(tmp_path / "m.gguf", hf, Q.F32, permute=True)
    prompts = prompts_for([40])
    llm = served(str(tmp_path / "m.gguf"), num_kv_blocks=64, max_model_len=512)
    assert ts_greedy(llm, prompts, 8) != hf_greedy(hf, prompts, 8)


def test_qwen3_and_phi3_gguf_configs(tmp_path: Path) -> None:
    folder = build_tiny_qwen3(tmp_path / "q", max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    write_gguf(tmp_path / "q.gguf", hf, Q.F32)
    cfg = gguf_model_config(read_gguf(str(tmp_path / "q.gguf")))
    # head_dim from qwen3.attention.key_length (32), not hidden / heads (16)
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == (
        "Qwen3ForCausalLM", 32, True, False)
    folder = build_tiny_phi3(tmp_path / "p", max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    write_gguf(tmp_path / "p.gguf", hf, Q.Q8_0)
    f = read_gguf(str(tmp_path / "p.gguf"))
    cfg = gguf_model_config(f)
    # phi3.attention.sliding_window is 0: no window (Phi-4's spelling), not a window of 0
    assert (cfg.architecture, cfg.sliding_window, cfg.sliding_window_layers) == (
        "Phi3ForCausalLM", None, ())
    # Packed: the fused blocks split by rows, each part the file's bytes of its rows.
    w = load_model(str(tmp_path / "p.gguf"), gguf_weights="packed", with_tokenizer=False).weights
    q, k, v = (w[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert all(is_packed(t) for t in (q, k, v)) and [t.shape[0] for t in (q, k, v)] == [64, 32, 32]
    stored = f.packed("blk.1.attn_qkv.weight")
    assert torch.equal(torch.cat([q, k, v]), stored)
    gate, up = w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(dequantize_reference(torch.cat([gate, up])),
                       dequantize_reference(f.packed("blk.0.ffn_up.weight")))
    # `tailserve plan` counts the parts as stored, by their canonical names.
    formats = packed_storage(f)
    assert formats["model.layers.1.self_attn.k_proj.weight"] == "Q8_0"
    assert formats["model.layers.0.mlp.up_proj.weight"] == "Q8_0"
    assert not any("qkv" in n or "gate_up" in n for n in formats)


def _refused(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The load error of ``path``, raised with no tensor read (reading one fails the test)."""
    def no_read(self: GGUFFile, name: str) -> torch.Tensor:
        raise AssertionError(f"{name} was read before the table was checked")
    monkeypatch.setattr(GGUFFile, "dequantize", no_read)
    monkeypatch.setattr(GGUFFile, "packed", no_read)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), with_tokenizer=False)
    return str(err.value)


def test_bad_qwen3_and_phi3_files_are_refused_from_the_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = AutoModelForCausalLM.from_pretrained(
        build_tiny_qwen3(tmp_path / "q", max_position_embeddings=2048), dtype=torch.float32)
    p = AutoModelForCausalLM.from_pretrained(
        build_tiny_phi3(tmp_path / "p", max_position_embeddings=2048), dtype=torch.float32)
    shape = ("hidden 64, 4 heads, 2 KV heads of 32, intermediate 128, vocab 49152, 2 layers")
    write_gguf(tmp_path / "missing.gguf", q, Q.Q8_0, drop=("blk.1.attn_k_norm.weight",))
    assert _refused(tmp_path / "missing.gguf", monkeypatch) == (
        f"{tmp_path / 'missing.gguf'} lacks 1 tensors its metadata implies ({shape}): "
        "blk.1.attn_k_norm.weight [32]")
    write_gguf(tmp_path / "qkv.gguf", p, Q.Q8_0,
               replace={"blk.0.attn_qkv.weight": torch.zeros(96, 64)})
    shape = shape.replace("of 32", "of 16")
    assert _refused(tmp_path / "qkv.gguf", monkeypatch) == (
        f"{tmp_path / 'qkv.gguf'}: tensor blk.0.attn_qkv.weight has shape [96, 64], but the "
        f"metadata ({shape}) implies [128, 64]")
    # An embedding model's file (llama.cpp's attention.causal false): refused by name.
    write_gguf(tmp_path / "bidi.gguf", q, Q.F32,
               metadata={"qwen3.attention.causal": (False, gguf.GGUFValueType.BOOL)})
    assert _refused(tmp_path / "bidi.gguf", monkeypatch) == (
        f"{tmp_path / 'bidi.gguf'}: the Qwen3ForCausalLM checkpoint asks for what tailserve's "
        "decoder does not serve: use_bidirectional_attention=True")
    # Phi-3's 128k variants: longrope, as factor tensors; refused by name.
    long = {"phi3.rope.scaling.attn_factor": (1.19, gguf.GGUFValueType.FLOAT32)}
    factors = {"rope_factors_long.weight": np.ones(8, np.float32),
               "rope_factors_short.weight": np.ones(8, np.float32)}
    write_gguf(tmp_path / "long.gguf", p, Q.F32, metadata=long, extra=factors)
    assert "stores longrope scaling (rope_factors_long.weight, rope_factors_short.weight" in (
        _refused(tmp_path / "long.gguf", monkeypatch))


def test_a_window_in_llama_metadata_is_read_or_refused(tmp_path: Path) -> None:
    """Mistral is stored as ``llama``; llama.cpp's converter writes it no window (llama.cpp
    serves it without one), but a file that has ``llama.attention.sliding_window`` gets it:
    on every layer (Mistral's meaning, tested against transformers above), or on the layers a
    ``sliding_window_pattern`` names; a pattern of another form is refused by name."""
    m = AutoModelForCausalLM.from_pretrained(
        build_tiny_mistral(tmp_path / "m", sliding_window=8), dtype=torch.float32)
    bools = {"llama.attention.sliding_window_pattern": ([True, False], gguf.GGUFValueType.ARRAY)}
    write_gguf(tmp_path / "bools.gguf", m, Q.F32, metadata=bools)
    cfg = gguf_model_config(read_gguf(str(tmp_path / "bools.gguf")))
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (8, (0,))
    every = {"llama.attention.sliding_window_pattern": (2, gguf.GGUFValueType.UINT32)}
    write_gguf(tmp_path / "every.gguf", m, Q.F32, metadata=every)
    cfg = gguf_model_config(read_gguf(str(tmp_path / "every.gguf")))
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (8, (0,))
    odd = {"llama.attention.sliding_window_pattern": ([True], gguf.GGUFValueType.ARRAY)}
    write_gguf(tmp_path / "odd.gguf", m, Q.F32, metadata=odd)
    with pytest.raises(ModelLoadError) as err:
        gguf_model_config(read_gguf(str(tmp_path / "odd.gguf")))
    assert str(err.value) == (
        f"{tmp_path / 'odd.gguf'} has llama.attention.sliding_window_pattern = [True]; expected "
        "one bool per layer (2) or a positive layer count")


@pytest.mark.usefixtures("cpu_kernels")
def test_phi3_split_blocks_serve_on_the_packed_kernels(tmp_path: Path) -> None:
    """The rows of Phi-3's fused Q8_0 blocks, split, run on the packed kernels (tiled, one-call
    step): within the int8-activation error of the float32 dequantization of the same file
    (test_gguf_packed.py's bound)."""
    p = AutoModelForCausalLM.from_pretrained(
        build_tiny_phi3(tmp_path / "p", max_position_embeddings=2048), dtype=torch.float32)
    write_gguf(tmp_path / "p.gguf", p, Q.Q8_0)
    f = read_gguf(str(tmp_path / "p.gguf"))
    config = gguf_model_config(f)
    runner = make_runner(config, load_gguf_weights(f, config, packed=True))
    # (the decoder stacks q, k, v and gate, up again: the parts' blocks, re-fused)
    assert type(runner.model.layers[0].self_attn.qkv_proj) is GGUFLinear
    assert type(runner.model.layers[0].mlp.gate_up_proj) is GGUFLinear
    assert runner.decode_graph is not None
    ref = make_runner(config, load_gguf_weights(f, config))
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    ref.kv_cache.copy_(runner.kv_cache)
    ids, positions, meta = decode_batch(runner, [1, 40, 17], seed=1)
    with torch.inference_mode():
        got = runner.model(ids, positions, runner.kv_caches, meta)
        want = ref.model(ids, positions, ref.kv_caches, meta)
    assert ((got - want).norm() / want.norm()).item() < TINY_RTOL
