"""Model families as data (issue 32, items 1, 2 and 4): each family's tiny random checkpoint,
built at test time from its transformers config class, gives transformers' greedy tokens, also
with chunked prefill, a prefix-cache hit and a preemption."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailserve import LLM, SamplingParams
from tailserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tailserve.errors import ModelLoadError
from tailserve.families import FAMILIES
from tailserve.model.loader import load_model
from test_engine_parity import hf_greedy, ts_greedy
from tiny_models import build_tiny_gemma3, build_tiny_mistral, build_tiny_phi3, build_tiny_qwen3

NEW_TOKENS = 32


def prompts_for(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(20, 49152, (n,), generator=g).tolist() for n in lengths]


def test_every_supported_architecture_is_one_declared_family() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == set(FAMILIES)
    assert FAMILIES["Qwen3ForCausalLM"].qk_norm and FAMILIES["Qwen2ForCausalLM"].attention_bias
    assert FAMILIES["Gemma3ForCausalLM"].sandwich_norms


# The small pool's blocks: a sliding-window model's local layers release the blocks their
# window passed (kv_groups.py), so a smaller pool is what makes three sequences too many.
@pytest.mark.parametrize("builder,new_tokens,small_pool", [
    (build_tiny_qwen3, NEW_TOKENS, 24), (build_tiny_phi3, NEW_TOKENS, 24),
    (functools.partial(build_tiny_mistral, sliding_window=8), NEW_TOKENS, 8),
    (build_tiny_gemma3, 64, 40),
], ids=["qwen3", "phi3", "mistral-window-8", "gemma3"])
def test_family_matches_transformers(tmp_path: Path, builder: Any, new_tokens: int,
                                     small_pool: int) -> None:
    folder = builder(tmp_path / "m", max_position_embeddings=2048)
    prompts = prompts_for([5, 40, 300])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, new_tokens)
    # Chunked prefill: a 64-token budget splits the 300-token prompt over five steps. Steps are
    # sized by the token budget alone: sized by time, a loaded host batches (and so rounds)
    # otherwise, and a random tiny model's near-ties flip.
    llm = LLM(folder, dtype="float32", num_kv_blocks=200, max_num_batched_tokens=64,
              slo_itl_ms=None, scheduling_policy="fcfs")
    assert ts_greedy(llm, prompts, new_tokens) == want
    # A prefix-cache hit: the same prompts again start from their cached blocks.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == want
    assert again[2].num_cached_tokens >= 288
    # Preemption: a pool too small for all three at once recomputes one; answers unchanged.
    small = LLM(folder, dtype="float32", num_kv_blocks=small_pool, max_num_batched_tokens=64,
                max_model_len=306 + new_tokens, enable_prefix_caching=False, slo_itl_ms=None,
                scheduling_policy="fcfs")
    assert ts_greedy(small, prompts, new_tokens) == want
    assert small.engine.scheduler.num_preemptions_total > 0


def test_phi3_fused_weights_are_split_by_the_config(tmp_path: Path) -> None:
    folder = build_tiny_phi3(tmp_path / "m")
    loaded = load_model(folder)
    w = loaded.weights
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert w["model.layers.0.mlp.up_proj.weight"].shape == (128, 64)
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in w)


def test_qwen3_config_reads_qk_norm_and_head_dim(tmp_path: Path) -> None:
    folder = build_tiny_qwen3(tmp_path / "m")
    cfg = load_model(folder).config
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.attention_bias) == (
        "Qwen3ForCausalLM", True, 32, False)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'Gemma2ForCausalLM'"):
        ModelConfig.from_hf({"architectures": ["Gemma2ForCausalLM"]})


def test_gemma3_config_reads_the_family_and_the_checkpoint(tmp_path: Path) -> None:
    folder = build_tiny_gemma3(tmp_path / "g")
    loaded = load_model(folder)
    cfg = loaded.config
    assert (cfg.architecture, cfg.qk_norm, cfg.sandwich_norms, cfg.hidden_act, cfg.head_dim) == (
        "Gemma3ForCausalLM", True, True, "gelu_pytorch_tanh", 32)
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (8, (0, 1))
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 2.0
    assert cfg.attention_scale == 24 ** -0.5
    assert (cfg.embedding_scale, cfg.final_logit_softcapping) == (8.0, 30.0)
    assert cfg.tie_word_embeddings
    # Gemma's norms compute x * (1 + w): the loader adds the 1 (the random norms are in
    # [0.5, 1.5]), so every norm weight read is in [1.5, 2.5].
    norms = [w for name, w in loaded.weights.items() if name.endswith("norm.weight")]
    assert len(norms) == 1 + 3 * 6
    assert all(w.dtype == torch.float32 and 1.5 <= float(w.min()) <= float(w.max()) <= 2.5
               for w in norms)
