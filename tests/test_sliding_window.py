"""Sliding-window attention served, and no silent wrong answers from checkpoint features the
decoder does not serve (issue 32, items 0 and 3).

A sliding-window checkpoint (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, the
``layer_types`` spelling, Gemma 3's ``sliding_window_pattern``) attends within its window on
CPU, per layer, past the window too: greedy tokens equal transformers', also with chunked
prefill and a prefix-cache hit. Where the window is not served (CUDA's Triton kernels)
``max_model_len`` resolves to at most the window. Every other config field the decoder does not
serve is refused by name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailserve import LLM, SamplingParams
from tailserve.config import EngineArgs, ModelConfig, kv_block_bytes, resolve_max_model_len
from tailserve.errors import ConfigError, ModelLoadError
from tailserve.model_features import sliding_window, sliding_window_layers, unsupported_features
from tailserve.platforms import Platform
from test_engine_parity import hf_greedy, ts_greedy
from tiny_models import build_tiny_gemma3, build_tiny_mistral, build_tiny_qwen2

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "hidden_act": "silu",
}


@pytest.mark.parametrize("cfg,window,layers", [
    ({}, None, ()),
    ({"sliding_window": None}, None, ()),
    ({"sliding_window": 4096}, 4096, (0, 1, 2, 3)),  # Mistral-7B-v0.1: every layer
    # Qwen2 checkpoints carry a window they do not use while the switch is off
    ({"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}, None, ()),
    ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 2}, 512, (2, 3)),
    ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 4}, None, ()),
    ({"sliding_window": 512, "layer_types": ["full_attention"] * 4}, None, ()),
    ({"sliding_window": 512,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, 512, (0, 2)),
    # Gemma 3's older spelling: every pattern-th layer global
    ({"sliding_window": 512, "sliding_window_pattern": 2}, 512, (0, 2)),
])
def test_sliding_window_spellings(cfg: dict[str, Any], window: int | None,
                                  layers: tuple[int, ...]) -> None:
    assert sliding_window({**LLAMA, **cfg}) == window
    assert sliding_window_layers({**LLAMA, **cfg}) == layers
    model = ModelConfig.from_hf({**LLAMA, **cfg})
    assert (model.sliding_window, model.sliding_window_layers) == (window, layers)
    assert [model.layer_sliding_window(i) for i in range(4)] == [
        window if i in layers else None for i in range(4)]


def test_gemma3_slides_five_layers_of_six_unless_told() -> None:
    gemma = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
             "sliding_window": 512}
    assert ModelConfig.from_hf(gemma).sliding_window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    with pytest.raises(ModelLoadError, match="layer_types names 2 layers, but num_hidden_layers "
                                             "is 12"):
        ModelConfig.from_hf({**gemma, "layer_types": ["sliding_attention"] * 2})


@pytest.mark.parametrize("value", [0, -8, "4096", 1.5])
def test_a_malformed_window_is_refused(value: Any) -> None:
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive number"):
        ModelConfig.from_hf({**LLAMA, "sliding_window": value})


@pytest.mark.parametrize("cfg,named", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"hidden_activation": "relu"}, "hidden_act='relu'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
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
              "head_dim": 32, "pretraining_tp": 2, "attention_dropout": 0.1,
              "final_logit_softcapping": 30.0, "use_bidirectional_attention": False}
    assert unsupported_features({**LLAMA, **served}) == []
    assert unsupported_features({**LLAMA, "hidden_activation": "gelu_pytorch_tanh"}) == []


def test_max_model_len_is_capped_at_the_window_where_it_is_not_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = ModelConfig.from_hf({**LLAMA, "sliding_window": 1024})
    # Served (CPU): the model's whole context.
    assert resolve_max_model_len(None, model) == 4096
    assert resolve_max_model_len(3000, model) == 3000
    with caplog.at_level(logging.WARNING, logger="tailserve.config"):
        assert resolve_max_model_len(None, model, window_served=False) == 1024
    assert "sliding window of 1024 tokens" in caplog.text
    assert "capped at 1024" in caplog.text
    assert resolve_max_model_len(1024, model, window_served=False) == 1024
    assert resolve_max_model_len(300, model, window_served=False) == 300
    with pytest.raises(ConfigError, match=r"max_model_len \(1025\) exceeds the model's sliding "
                                          r"attention window \(1024 tokens\)"):
        resolve_max_model_len(1025, model, window_served=False)
    with pytest.raises(ConfigError, match="exceeds the model's context length"):
        resolve_max_model_len(5000, model)
    # A window at least the context length never binds.
    wide = ModelConfig.from_hf({**LLAMA, "sliding_window": 4096})
    assert resolve_max_model_len(None, wide, window_served=False) == 4096


def test_engine_args_resolution_caps_on_cuda_only() -> None:
    model = ModelConfig.from_hf({**LLAMA, "sliding_window": 256})
    cpu = EngineArgs(dtype="float32").resolve_unsized(model, Platform(cuda_available=False))
    assert cpu.scheduler.max_model_len == 4096
    cuda = EngineArgs(dtype="float32").resolve_unsized(model, Platform(cuda_available=True))
    assert cuda.scheduler.max_model_len == 256


WINDOW = 8
NEW_TOKENS = 64


def _prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(20, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("builder,overrides", [
    (build_tiny_mistral, {"sliding_window": WINDOW}),  # every layer slides
    # Qwen2: the second layer slides, the first is global (per-layer windows)
    (build_tiny_qwen2, {"use_sliding_window": True, "sliding_window": WINDOW,
                        "max_window_layers": 1}),
], ids=["mistral", "qwen2-per-layer"])
def test_sliding_window_matches_transformers_past_the_window(
    tmp_path: Path, builder: Any, overrides: dict[str, Any], caplog: pytest.LogCaptureFixture,
) -> None:
    """The issue's checkpoint: a Mistral with ``sliding_window=8`` and prompts of 24 and 40
    tokens (and 64 generated), far past the window: greedy tokens equal transformers' with the
    CPU kernels (whose attention, and the one-call step, hand a step with a context past the
    window to the reference attention: logged), with chunked prefill and a prefix-cache hit."""
    folder = builder(tmp_path / "m", **overrides)
    prompts = _prompts([24, 40, 5])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    with caplog.at_level(logging.INFO, logger="tailserve.model.cpu_decode"):
        # A 16-token budget prefills the 40-token prompt in three chunks.
        llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                  max_num_seqs=4, slo_itl_ms=None, scheduling_policy="fcfs")
    assert llm.engine.config.scheduler.max_model_len == 512
    if llm.engine.runner.cpu_kernels:
        assert f"sliding window of {WINDOW} tokens" in caplog.text
    assert ts_greedy(llm, prompts, NEW_TOKENS) == want
    # A prefix-cache hit: the cached blocks' K/V are read through the window mask.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == want
    assert again[1].num_cached_tokens >= 32


def test_sliding_window_without_the_kernels(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILSERVE_CPU_KERNELS", "0")
    folder = build_tiny_mistral(tmp_path / "m", sliding_window=WINDOW)
    prompts = _prompts([24, 3])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              max_num_seqs=4, slo_itl_ms=None, scheduling_policy="fcfs")
    assert not llm.engine.runner.cpu_kernels
    assert ts_greedy(llm, prompts, 32) == hf_greedy(hf, prompts, 32)


def test_local_layers_release_their_blocks(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32 item 3: Gemma 3's two sliding layers of three keep only their window's
    blocks (KV cache groups: one global, two local, blocks of one layer), so a pool of 48
    one-layer blocks (16 blocks of all three layers: 256 tokens, were every layer global)
    serves a 300-token prompt and 64 tokens, chunked, with transformers' greedy tokens."""
    folder = build_tiny_gemma3(tmp_path / "m", max_position_embeddings=2048)
    prompts = _prompts([300])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO, logger="tailserve.engine.build"):
        llm = LLM(folder, dtype="float32", num_kv_blocks=48, max_model_len=512,
                  max_num_batched_tokens=64, slo_itl_ms=None, scheduling_policy="fcfs")
    cache = llm.engine.config.cache
    assert cache.kv_groups is not None
    assert (cache.kv_groups.group_windows, cache.kv_groups.layers_per_block) == ((None, 8, 8), 1)
    assert kv_block_bytes(llm.engine.config.model, 16, "float32") == 3 * cache.block_bytes
    # 512 tokens: 32 global blocks + 2 x (8 / 16 + 1 = 2) local = 36 of 96: 38%; one fits 47.
    assert ("KV cache groups ['global', 8, 8] (blocks of 1 layers): a 512-token sequence holds"
            in caplog.text)
    assert "38% of the" in caplog.text and "1 such sequences fit the pool" in caplog.text
    assert ts_greedy(llm, prompts, NEW_TOKENS) == hf_greedy(hf, prompts, NEW_TOKENS)
    # Every block came back: the pool less the null block.
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 47
