"""Synthetic checkpoints with the published shapes of Llama 3.x models, random weights.

benchmarks/real_sizes.py measures serving at real sizes without downloading any weights:
a decode step reads every stored byte whatever the values are, and with ``ignore_eos`` the
output lengths do not depend on them either, so random weights time the same as trained
ones. What must be real is the shape (every matrix, the vocabulary, the K/V heads) and the
storage format; both are written here.

    GGUF  F32 norms, every matrix in Q8_0 or Q4_0, quantized by the ``gguf`` package's own
          quantizers (the tied embedding too, as llama.cpp's pure types store it); Q4_K_M by
          llama.cpp's llama-quantize from the Q8_0 file (--allow-requantize: the rounding
          of random weights is of no interest, and it spares a 16 GB F16 intermediate for 8B)
    HF    config.json + bf16 safetensors (for vLLM) and the tokenizer (for the clients)

The tokenizer is the bundled SmolLM2's byte-level BPE (49,152 tokens, 48,900 merges) with
the vocabulary padded to Llama 3's 128,256 by unused tokens no merge reaches: the embedding
and LM head have the published [128256, hidden] shape, prompts are counted in this
tokenizer's tokens by every client, and sampling from random logits may emit a padded id
(decoded as its placeholder text). Llama 3's own tokenizer would only change which ids a text
becomes, not the bytes a step reads.

Not written: Llama 3.1/3.2's "llama3" rope scaling (a per-frequency factor: the same work per
token; tailserve's GGUF loader refuses the ``rope_freqs`` tensor llama.cpp stores it as).
"""

from __future__ import annotations

import json
import os
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

VOCAB_SIZE = 128_256  # Llama 3's tokenizer: 128,000 BPE tokens + 256 reserved specials
QTYPES = ("Q4_0", "Q4_K_M", "Q8_0")


@dataclass(frozen=True)
class Shape:
    """The figures of each model's config.json as published on the Hugging Face Hub
    (meta-llama/Llama-3.2-1B, meta-llama/Llama-3.2-3B, meta-llama/Llama-3.1-8B; identical in
    their -Instruct twins), which Meta's model cards repeat: hidden size, layers, attention
    and K/V heads, MLP width, vocabulary 128,256, rope theta 500,000, RMSNorm eps 1e-5,
    131,072 positions; the 1B and 3B tie the LM head to the embedding, the 8B does not."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131_072

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SHAPES = {s.name: s for s in (
    Shape("llama-3.2-1b", 2048, 16, 32, 8, 8192, tie_word_embeddings=True),
    Shape("llama-3.2-3b", 3072, 28, 24, 8, 8192, tie_word_embeddings=True),
    Shape("llama-3.1-8b", 4096, 32, 32, 8, 14336, tie_word_embeddings=False),
)}
# Normal(0, INIT_STD) matrices (the init Llama's config names, initializer_range): with unit
# RMSNorm weights the logits stay within a few units, so sampling is neither one-hot nor NaN.
INIT_STD = 0.02


def hf_tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every stored tensor, in file order."""
    h, kv = s.hidden_size, s.num_key_value_heads * s.head_dim
    yield "model.embed_tokens.weight", (s.vocab_size, h)
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (s.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (s.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, s.intermediate_size)
    yield "model.norm.weight", (h,)
    if not s.tie_word_embeddings:
        yield "lm_head.weight", (s.vocab_size, h)


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The bf16 tensor ``name`` holds: seeded by its name, so the HF folder and the GGUF,
    written apart, hold the same model. Norm weights are ones (a trained model's are near 1)."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * INIT_STD).to(torch.bfloat16)


# ---------------------------------------------------------------------------- HF folder
def hf_config(s: Shape) -> dict[str, object]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_hidden_layers,
            "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim,
            "vocab_size": s.vocab_size, "rope_theta": s.rope_theta,
            "rms_norm_eps": s.rms_norm_eps, "hidden_act": "silu",
            "max_position_embeddings": s.max_position_embeddings,
            "tie_word_embeddings": s.tie_word_embeddings, "torch_dtype": "bfloat16",
            "attention_bias": False, "mlp_bias": False, "initializer_range": INIT_STD,
            "bos_token_id": 1, "eos_token_id": 2}  # the tokenizer's (SmolLM2's) ids


def write_hf_config(s: Shape, folder: str) -> None:
    """config.json: beside the tokenizer it makes the folder one the clients' tokenizer
    loaders accept (tailserve bench asks for a model folder), weights or not."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(s), f, indent=1)


def write_hf_weights(s: Shape, folder: str, seed: int, shard_bytes: int = 2 << 30) -> None:
    """config.json + bf16 safetensors shards of at most ``shard_bytes`` (one shard in memory
    at a time: the 8B is 16 GB) + the index; model.safetensors.index.json last, so a folder
    with it is complete."""
    from safetensors.torch import save_file

    write_hf_config(s, folder)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        fname = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        shard, size = {}, 0

    for name, shape in hf_tensors(s):
        t = random_tensor(name, shape, seed)
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[name] = t
        size += nbytes
        total += nbytes
    if shard:
        flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


# ---------------------------------------------------------------------------- GGUF
def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for a Hugging Face one (its llama architecture's names)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    part = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
            "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
            "self_attn.o_proj.weight": "attn_output",
            "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "ffn_gate",
            "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}[rest]
    return f"blk.{layer}.{part}.weight"


def rope_rows_interleaved(w: np.ndarray, num_heads: int) -> np.ndarray:
    """q/k rows from Hugging Face's rotate-half order (a head's first half of rows pairs with
    its second half) to GGUF's interleaved pairs (rows 2i, 2i+1), which GGUF readers,
    tailserve's loader among them, undo: without it the GGUF would be a different model from
    the HF folder. [out, in] -> [out, in]"""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def bundled_tokenizer_fields() -> dict[str, object]:
    """The bundled SmolLM2 GGUF's tokenizer: tokens, types, merges, special ids."""
    import gguf

    from tailserve.model.loader import default_model_path

    r = gguf.GGUFReader(default_model_path())

    def field(key: str) -> object:
        return r.fields[key].contents()

    keys = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id", "add_bos_token")
    return {k: field(f"tokenizer.ggml.{k}") for k in keys}


def write_gguf(s: Shape, qtype: str, path: str, seed: int) -> None:
    """A llama GGUF of ``s`` with every matrix in ``qtype`` (Q8_0 or Q4_0) and F32 norms,
    quantized one tensor at a time and streamed to ``path`` (the 8B's float32 never whole in
    memory)."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    tok = bundled_tokenizer_fields()
    tokens = list(tok["tokens"])  # type: ignore[call-overload]
    types = list(tok["token_type"])  # type: ignore[call-overload]
    pad = s.vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    # NORMAL, not UNUSED: llama-server renders an UNUSED (or CONTROL) token as no text, and
    # random logits pick padded ids more often than not, so a stream could end with no text
    # at all (tailserve bench's test request refuses that). No merge reaches them: a prompt
    # never becomes one.
    types += [int(gguf.TokenType.NORMAL)] * pad

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"{s.name} (random weights, tailserve benchmarks/real_sizes.py)")
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_block_count(s.num_hidden_layers)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_attention_heads)
    w.add_head_count_kv(s.num_key_value_heads)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_vocab_size(s.vocab_size)
    w.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{qtype}"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model(str(tok["model"]))
    w.add_tokenizer_pre(str(tok["pre"]))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(tok["merges"]))  # type: ignore[call-overload]
    w.add_bos_token_id(int(tok["bos_token_id"]))  # type: ignore[call-overload]
    w.add_eos_token_id(int(tok["eos_token_id"]))  # type: ignore[call-overload]
    w.add_unk_token_id(int(tok["unknown_token_id"]))  # type: ignore[call-overload]
    w.add_pad_token_id(int(tok["padding_token_id"]))  # type: ignore[call-overload]
    w.add_add_bos_token(bool(tok["add_bos_token"]))

    tensors = list(hf_tensors(s))
    for name, shape in tensors:  # the header first: names, shapes, types, byte sizes
        if len(shape) == 1:
            w.add_tensor_info(gguf_name(name), shape, np.dtype(np.float32), 4 * shape[0])
        else:
            nbytes = gguf.quant_shape_to_byte_shape(shape, qt)
            w.add_tensor_info(gguf_name(name), nbytes, np.dtype(np.uint8),
                              int(np.prod(nbytes)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    heads = {"q_proj": s.num_attention_heads, "k_proj": s.num_key_value_heads}
    for name, shape in tensors:
        x = random_tensor(name, shape, seed).float().numpy()
        if len(shape) == 1:
            w.write_tensor_data(x)
            continue
        proj = name.split(".")[-2]
        if proj in heads:
            x = rope_rows_interleaved(x, heads[proj])
        # Rows in chunks: the quantizer's temporaries are several times its input.
        rows = max(1, (64 << 20) // (4 * shape[1]))
        w.write_tensor_data(np.concatenate(
            [gguf.quants.quantize(x[i:i + rows], qt) for i in range(0, shape[0], rows)]))
    w.close()


def requantize(llama_quantize: str, src: str, dst: str, qtype: str, threads: int) -> None:
    """llama.cpp's quantizer from ``src`` (Q8_0) to ``qtype`` (Q4_K_M: its mix of Q4_K and
    Q6_K per tensor role)."""
    subprocess.run([llama_quantize, "--allow-requantize", src, dst, qtype, str(threads)],
                   check=True)


def write_tokenizer(gguf_path: str, folder: str) -> None:
    """The GGUF's tokenizer as a Hugging Face folder (tokenizer.json + tokenizer_config.json)
    for the clients and vLLM: built from the file by the loader tailserve serves it with, so
    every server and client counts the same ids."""
    from tailserve.model.tokenizer import load_gguf_tokenizer

    load_gguf_tokenizer(gguf_path).save_pretrained(folder)


def shape_json(s: Shape) -> dict[str, object]:
    return asdict(s) | {"head_dim": s.head_dim}
