"""Greedy tokens and logits of tailserve against transformers on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailserve import LLM, SamplingParams
from tiny_models import build_tiny_llama, build_tiny_qwen2

LENGTHS = [1, 7, 64, 300, 1100]


def prompts_for(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    # Skip the first ids: SmolLM2's special tokens live there.
    return [torch.randint(20, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def ts_greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "builder,overrides",
    [
        (build_tiny_llama, {}),
        (build_tiny_llama, {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        (build_tiny_llama, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (build_tiny_llama, {"rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}),
        (build_tiny_qwen2, {}),
    ],
    ids=["llama", "llama-tied-mqa", "rope-linear", "rope-llama3", "qwen2-bias"],
)
def test_tiny_models_match_transformers(
    tmp_path: Path, builder: Any, overrides: dict[str, Any]
) -> None:
    folder = builder(tmp_path / "m", max_position_embeddings=2048, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = prompts_for(hf.config.vocab_size, LENGTHS)
    llm = LLM(folder, dtype="float32", num_kv_blocks=400, max_num_batched_tokens=256)
    assert ts_greedy(llm, prompts, 8) == hf_greedy(hf, prompts, 8)


def test_torch_fallback_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the compiled CPU kernels (no compiler on the host) the pure-torch paths serve."""
    monkeypatch.setenv("TAILSERVE_CPU_KERNELS", "0")
    folder = build_tiny_llama(tmp_path / "m", max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = prompts_for(hf.config.vocab_size, LENGTHS)
    llm = LLM(folder, dtype="float32", num_kv_blocks=400, max_num_batched_tokens=256)
    assert not llm.engine.runner.cpu_kernels
    assert ts_greedy(llm, prompts, 8) == hf_greedy(hf, prompts, 8)


def test_default_model_matches_transformers_greedy(default_llm: LLM, hf_default: Any) -> None:
    prompts = prompts_for(49152, LENGTHS)
    assert ts_greedy(default_llm, prompts, 6) == hf_greedy(hf_default, prompts, 6)


def _hf_logprobs(model: Any, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        logits = model.to(dtype)(torch.tensor([prompt])).logits[0, -1].float()
    model.to(torch.float32)
    return torch.log_softmax(logits, -1)


def _ts_logprobs(loaded: Any, dtype: str, prompts: list[list[int]]) -> list[dict[int, float]]:
    from tailserve.config import EngineArgs
    from tailserve.engine.core import EngineCore
    from tailserve.request import Request

    core = EngineCore.from_args(
        EngineArgs(dtype=dtype, num_kv_blocks=200, max_model_len=2048), loaded
    )
    for i, p in enumerate(prompts):
        core.add_request(
            Request(str(i), p, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
        )
    got: dict[str, dict[int, float]] = {}
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            assert o.new_logprobs is not None
            got[o.request_id] = o.new_logprobs[0]
    return [got[str(i)] for i in range(len(prompts))]


def test_default_model_logits_agree_float32(default_loaded: Any, hf_default: Any) -> None:
    prompts = prompts_for(49152, [5, 200, 700])
    for p, got in zip(prompts, _ts_logprobs(default_loaded, "float32", prompts), strict=True):
        ref = _hf_logprobs(hf_default, p, torch.float32)
        ids = list(got)
        assert ids[:5] == ref.topk(5).indices.tolist()
        assert torch.allclose(torch.tensor([got[t] for t in ids]), ref[ids], atol=1e-3, rtol=0)


def test_default_model_logits_agree_bfloat16(default_loaded: Any, hf_default: Any) -> None:
    """bf16 has 8 mantissa bits: judge our bf16 error against transformers' own bf16 error,
    both measured from the float32 reference on the top-20 tokens."""
    prompts = prompts_for(49152, [5, 120])
    for p, got in zip(prompts, _ts_logprobs(default_loaded, "bfloat16", prompts), strict=True):
        ref32 = _hf_logprobs(hf_default, p, torch.float32)
        ref16 = _hf_logprobs(hf_default, p, torch.bfloat16)
        ids = list(got)
        ours_err = (torch.tensor([got[t] for t in ids]) - ref32[ids]).abs().max().item()
        hf_err = (ref16[ids] - ref32[ids]).abs().max().item()
        assert ours_err <= 2 * hf_err + 0.05, (ours_err, hf_err)
        assert ids[0] in ref32.topk(3).indices.tolist()
