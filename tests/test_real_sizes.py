"""benchmarks/real_sizes_write.py: the published shapes and a synthetic GGUF that tailserve
reads back as the same model as the HF folder's tensors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_sizes_write as rw  # noqa: E402


def test_parameter_counts_are_the_published_ones() -> None:
    # Meta's model cards: 1.23B, 3.21B, 8.03B (the exact counts of the Hub checkpoints).
    counts = {n: sum(math.prod(shape) for _, shape in rw.hf_tensors(s))
              for n, s in rw.SHAPES.items()}
    assert counts == {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
                      "llama-3.1-8b": 8_030_261_248}
    names = [n for n, _ in rw.hf_tensors(rw.SHAPES["llama-3.1-8b"])]
    assert names[-1] == "lm_head.weight" and "lm_head.weight" not in dict(
        rw.hf_tensors(rw.SHAPES["llama-3.2-1b"]))
    assert rw.gguf_name("model.layers.3.mlp.down_proj.weight") == "blk.3.ffn_down.weight"
    assert rw.gguf_name("model.embed_tokens.weight") == "token_embd.weight"


def test_a_tiny_gguf_loads_as_the_same_model(tmp_path: Path) -> None:
    from tailserve.model.loader import load_model

    s = rw.Shape("tiny", 256, 2, 4, 2, 512, tie_word_embeddings=True)
    path = tmp_path / "tiny-Q8_0.gguf"
    rw.write_gguf(s, "Q8_0", str(path), seed=3)
    m = load_model(str(path))  # dequantized to float32, under Hugging Face names
    assert m.config.vocab_size == 128_256 and m.config.num_key_value_heads == 2
    assert m.config.rope_theta == 500_000.0 and m.config.tie_word_embeddings
    assert len(m.tokenizer) == 128_256
    for name in ("model.layers.1.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        want = rw.random_tensor(name, dict(rw.hf_tensors(s))[name], 3).float()
        # Q8_0 keeps a block's values to 1/254 of its largest: rows in the HF order again.
        torch.testing.assert_close(m.weights[name], want, atol=want.abs().max() / 100, rtol=0)
    assert torch.equal(m.weights["model.norm.weight"], torch.ones(256))
    with pytest.raises(KeyError):
        rw.gguf_name("model.layers.0.nope.weight")
