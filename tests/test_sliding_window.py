"""No silent wrong answers from checkpoint features the decoder does not serve (issue 32, item 0).

A sliding-window checkpoint (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, the
``layer_types`` spelling) is served up to its window only: ``max_model_len`` resolves to at most
the window, where its answers equal a global-attention decoder's; past it the engine would be
another model. Every other config field the decoder does not serve is refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailserve import LLM, SamplingParams
from tailserve.config import EngineArgs, ModelConfig, resolve_max_model_len
from tailserve.errors import ConfigError, InvalidRequestError, ModelLoadError
from tailserve.model_features import sliding_window, unsupported_features
from tailserve.platforms import Platform
from test_engine_parity import hf_greedy
from tiny_models import build_tiny_mistral, build_tiny_qwen2

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "hidden_act": "silu",
}


@pytest.mark.parametrize("cfg,window", [
    ({}, None),
    ({"sliding_window": None}, None),
    ({"sliding_window": 4096}, 4096),  # Mistral-7B-v0.1: every layer
    # Qwen2 checkpoints carry a window they do not use while the switch is off
    ({"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}, None),
    ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 2}, 512),
    ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 4}, None),
    ({"sliding_window": 512, "layer_types": ["full_attention"] * 4}, None),
    ({"sliding_window": 512,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, 512),
])
def test_sliding_window_spellings(cfg: dict[str, Any], window: int | None) -> None:
    assert sliding_window({**LLAMA, **cfg}) == window
    assert ModelConfig.from_hf({**LLAMA, **cfg}).sliding_window == window


@pytest.mark.parametrize("value", [0, -8, "4096", 1.5])
def test_a_malformed_window_is_refused(value: Any) -> None:
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive number"):
        ModelConfig.from_hf({**LLAMA, "sliding_window": value})


@pytest.mark.parametrize("cfg,named", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ({"use_qk_norm": True}, "use_qk_norm=True"),
    ({"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types=['chunked_attention']"),
])
def test_unserved_fields_are_refused_by_name(cfg: dict[str, Any], named: str) -> None:
    assert unsupported_features({**LLAMA, **cfg}) == [named]
    with pytest.raises(ModelLoadError, match=f"does not serve: {named}".replace("[", r"\[")
                       .replace("(", r"\(")):
        ModelConfig.from_hf({**LLAMA, **cfg})


def test_served_fields_are_not_refused() -> None:
    served = {"hidden_act": "silu", "mlp_bias": False, "attn_logit_softcapping": None,
              "partial_rotary_factor": 1.0, "attention_bias": True, "tie_word_embeddings": True,
              "head_dim": 32, "pretraining_tp": 2, "attention_dropout": 0.1}
    assert unsupported_features({**LLAMA, **served}) == []


def test_max_model_len_is_capped_at_the_window(caplog: pytest.LogCaptureFixture) -> None:
    model = ModelConfig.from_hf({**LLAMA, "sliding_window": 1024})
    with caplog.at_level(logging.WARNING, logger="tailserve.config"):
        assert resolve_max_model_len(None, model) == 1024
    assert "sliding window of 1024 tokens" in caplog.text
    assert "capped at 1024" in caplog.text
    assert resolve_max_model_len(1024, model) == 1024
    assert resolve_max_model_len(300, model) == 300
    with pytest.raises(ConfigError, match=r"max_model_len \(1025\) exceeds the model's sliding "
                                          r"attention window \(1024 tokens\)"):
        resolve_max_model_len(1025, model)
    with pytest.raises(ConfigError, match="exceeds the model's context length"):
        resolve_max_model_len(5000, model)
    # A window at least the context length never binds.
    wide = ModelConfig.from_hf({**LLAMA, "sliding_window": 4096})
    assert resolve_max_model_len(None, wide) == 4096


def test_mistral_with_a_window_is_served_up_to_it_and_matches_transformers(
    tmp_path: Path,
) -> None:
    """The issue's checkpoint: a Mistral with ``sliding_window`` shorter than its context. Within
    the window tailserve's greedy tokens are transformers'; a prompt past it is refused with the
    numbers instead of answered by a model without a window."""
    folder = build_tiny_mistral(tmp_path / "m", sliding_window=24)
    llm = LLM(folder, dtype="float32", num_kv_blocks=64)
    assert llm.engine.config.scheduler.max_model_len == 24
    prompt = torch.randint(20, 1000, (16,), generator=torch.Generator().manual_seed(7)).tolist()
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert out == hf_greedy(hf, [prompt], 8)[0]
    with pytest.raises(InvalidRequestError, match="max_model_len is 24"):
        llm.generate({"prompt_token_ids": prompt * 2}, sp)


def test_asking_past_the_window_is_a_start_up_error(tmp_path: Path) -> None:
    folder = build_tiny_qwen2(tmp_path / "q", use_sliding_window=True, sliding_window=32,
                              max_window_layers=1)
    with pytest.raises(ConfigError, match=r"sliding attention window \(32 tokens\)"):
        LLM(folder, dtype="float32", num_kv_blocks=64, max_model_len=64)


def test_engine_args_resolution_caps_without_a_flag() -> None:
    model = ModelConfig.from_hf({**LLAMA, "sliding_window": 256})
    unsized = EngineArgs(dtype="float32").resolve_unsized(model, Platform(cuda_available=False))
    assert unsized.scheduler.max_model_len == 256
