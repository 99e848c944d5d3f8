"""``apply_gguf_weights``: serve a GGUF's quantized matrices from their stored blocks.

=================  ================  ===============================================
plain module       swapped for       computes, in one op each
=================  ================  ===============================================
``nn.Linear``      ``GGUFLinear``    ``quant_linear``: x in int8 blocks against the
                                     weight's blocks (decode rows and prefill alike)
``nn.Embedding``   ``GGUFEmbedding`` ``quant_embedding``: the looked-up rows only
=================  ================  ===============================================

It runs before ``load_weights``, on the packed tensors the loader kept (``load_model(...,
gguf_weights="packed")``): q/k/v and gate/up are fused by concatenating their rows of blocks,
as the float model concatenates their rows of values. A tied LM head reads the embedding's
blocks (the bundled model: one Q8_0 table of 27 MB instead of two float32 copies of 113 MB).
Where the parts of a fused projection are stored in different formats (Q4_K_M files keep some
``v`` / ``down`` matrices in Q6_K) the module keeps one block tensor per run of a format and
concatenates their outputs. Where a part is not packed at all (an F16 matrix), the others are
dequantized and the ``nn.Linear`` stays, for ``load_weights`` and ``apply_cpu_kernels``.
"""

from __future__ import annotations

import typing
from collections import Counter

import torch
from torch import nn

from tailserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from tailserve.model.quant.formats import (
    dequantize_reference,
    format_of,
    is_packed,
)
from tailserve.model.transforms.report import TransformReport


class GGUFLinear(nn.Module):
    """``y = x W^T (+ b)`` with W as GGUF blocks: one packed tensor per run of one format,
    concatenated along the outputs."""

    bias: torch.Tensor | None

    def __init__(self, parts: list[torch.Tensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        if not parts or any(not is_packed(p) for p in parts):
            raise ValueError("GGUFLinear takes packed GGUF tensors [rows, blocks, type_size]")
        self.in_features = parts[0].shape[1] * format_of(parts[0]).block_size
        if any(p.shape[1] * format_of(p).block_size != self.in_features for p in parts):
            raise ValueError("GGUFLinear parts disagree on in_features")
        self.out_features = sum(p.shape[0] for p in parts)
        self.num_parts = len(parts)
        for i, p in enumerate(parts):
            self.register_buffer(f"part{i}", p, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def parts(self) -> list[torch.Tensor]:
        return [typing.cast(torch.Tensor, getattr(self, f"part{i}")) for i in range(self.num_parts)]

    @property
    def packed(self) -> torch.Tensor | None:
        """The one block tensor, where the weight is in one format (what decode_layers reads)."""
        return self.parts[0] if self.num_parts == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_parts == 1:
            return torch.ops.tailserve.quant_linear(x, self.part0, self.bias)
        y = torch.cat([torch.ops.tailserve.quant_linear(x, p, None) for p in self.parts], dim=1)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        formats = "+".join(format_of(p).name for p in self.parts)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={formats}")


class GGUFEmbedding(nn.Module):
    """Token embeddings from a packed table: only the rows looked up are dequantized."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table: torch.Tensor
        self.register_buffer("table", table, persistent=False)
        self.num_embeddings = table.shape[0]
        self.embedding_dim = table.shape[1] * format_of(table).block_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = torch.ops.tailserve.quant_embedding(flat, self.table)
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"format={format_of(self.table).name}")


def has_packed(weights: dict[str, torch.Tensor]) -> bool:
    return any(is_packed(t) for t in weights.values())


def _runs(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive parts of one format concatenated (their rows of blocks line up)."""
    runs: list[list[torch.Tensor]] = []
    for p in parts:
        if runs and runs[-1][0].shape[2] == p.shape[2]:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [torch.cat(r) if len(r) > 1 else r[0] for r in runs]


def apply_gguf_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> TransformReport:
    """Swap the linears and the embedding whose weights are packed for their GGUF forms, in
    place, before ``load_weights``; ``weights`` entries the swap consumed are left in place
    (``load_weights`` skips swapped modules) and parts it had to dequantize are replaced."""
    if not has_packed(weights):
        return TransformReport()
    llama = typing.cast(LlamaForCausalLM, model)
    cfg = llama.config
    swapped: Counter[str] = Counter()

    def fused(linear: nn.Linear, names: list[str], bias_names: list[str]) -> nn.Module:
        parts = [weights[n] for n in names]
        if not all(is_packed(p) for p in parts):
            for n in names:  # a float part: the float linear serves, loaded from values
                if is_packed(weights[n]):
                    weights[n] = dequantize_reference(weights[n])
            return linear
        bias = torch.cat([weights[n] for n in bias_names]) if bias_names else None
        swapped[type(linear).__name__] += 1
        return GGUFLinear(_runs(parts), bias)

    embed = weights["model.embed_tokens.weight"]
    head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
    # setattr: the model's attributes are typed as the plain modules this swaps out.
    if is_packed(embed):
        setattr(llama, "embed_tokens", GGUFEmbedding(embed))  # noqa: B010
        swapped["Embedding"] += 1
    if is_packed(head):
        setattr(llama, "lm_head", GGUFLinear([head], None))  # noqa: B010
        swapped["Linear"] += 1
    for i, module in enumerate(llama.layers):
        layer = typing.cast(LlamaDecoderLayer, module)
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        biases = [p + f"self_attn.{n}_proj.bias" for n in "qkv"] if cfg.attention_bias else []
        for owner, attr, names, bias_names in (
            (attn, "qkv_proj", [p + f"self_attn.{n}_proj.weight" for n in "qkv"], biases),
            (attn, "o_proj", [p + "self_attn.o_proj.weight"], []),
            (mlp, "gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], []),
            (mlp, "down_proj", [p + "mlp.down_proj.weight"], []),
        ):
            setattr(owner, attr, fused(getattr(owner, attr), names, bias_names))
    return TransformReport(swapped=dict(swapped))

