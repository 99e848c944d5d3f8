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

Matrices of the 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with a multiple of 16 rows are
regrouped here into tiles of 16 rows (``quant.formats.tile_blocks``: the same bytes, in the
order the kernels' integer dot products read them, so no call rebuilds that order); the
K-quants, and matrices of other row counts, stay as stored. The ``weights`` entries a module
took are then replaced by views of its tensor (a fused part: its rows of the fused tiles), so
the caller's dict and the model share one copy of every matrix.
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
    TILE_ROWS,
    dequantize_reference,
    format_of,
    is_packed,
    is_tiled,
    logical_shape,
    tile_blocks,
    untile_blocks,
)
from tailserve.model.transforms.report import TransformReport


class GGUFLinear(nn.Module):
    """``y = x W^T (+ b)`` with W as GGUF blocks: one packed tensor (stored or tiled) per run
    of one format, concatenated along the outputs."""

    bias: torch.Tensor | None

    def __init__(self, parts: list[torch.Tensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        if not parts or any(not is_packed(p) for p in parts):
            raise ValueError("GGUFLinear takes packed GGUF tensors [rows, blocks, type_size] "
                             "or tiled ones [rows / 16, blocks, 16, type_size]")
        self.in_features = logical_shape(parts[0])[1]
        if any(logical_shape(p)[1] != self.in_features for p in parts):
            raise ValueError("GGUFLinear parts disagree on in_features")
        self.out_features = sum(logical_shape(p)[0] for p in parts)
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
        formats = "+".join(format_of(p).name + (" tiled" if is_tiled(p) else "")
                           for p in self.parts)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={formats}")


class GGUFEmbedding(nn.Module):
    """Token embeddings from a packed table: only the rows looked up are dequantized."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table: torch.Tensor
        self.register_buffer("table", table, persistent=False)
        self.num_embeddings, self.embedding_dim = logical_shape(table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = torch.ops.tailserve.quant_embedding(flat, self.table)
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"format={format_of(self.table).name}{' tiled' if is_tiled(self.table) else ''}")


def has_packed(weights: dict[str, torch.Tensor]) -> bool:
    return any(is_packed(t) for t in weights.values())


def _runs(parts: list[torch.Tensor]) -> list[list[int]]:
    """Indices of the consecutive parts of one format (their rows of blocks line up)."""
    runs: list[list[int]] = []
    for i, p in enumerate(parts):
        if runs and format_of(parts[runs[-1][0]]) == format_of(p):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """Parts of one format concatenated by rows and tiled where ``tile_blocks`` can. Parts
    tiled already (a second runner on the same dict) are concatenated as tiles."""
    if len(parts) == 1:
        return tile_blocks(parts[0])
    if all(is_tiled(p) for p in parts):
        return torch.cat(parts)
    return tile_blocks(torch.cat([untile_blocks(p) for p in parts]))


def _views(fused: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each part's rows of ``fused`` (None where a part's rows do not make whole tiles)."""
    views: list[torch.Tensor | None] = []
    row = 0
    for p in parts:
        rows = logical_shape(p)[0]
        if not is_tiled(fused):
            views.append(fused.narrow(0, row, rows))
        elif row % TILE_ROWS == 0 and rows % TILE_ROWS == 0:
            views.append(fused.narrow(0, row // TILE_ROWS, rows // TILE_ROWS))
        else:
            views.append(None)
        row += rows
    return views


def apply_gguf_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> TransformReport:
    """Swap the linears and the embedding whose weights are packed for their GGUF forms, in
    place, before ``load_weights``. ``weights`` entries the swap consumed are replaced by views
    of the modules' (tiled) tensors (``load_weights`` skips swapped modules), parts it had to
    dequantize by their values."""
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
        tensors = []
        for run in _runs(parts):
            tensor = _fuse([parts[i] for i in run])
            for i, view in zip(run, _views(tensor, [parts[i] for i in run]), strict=True):
                if view is not None:  # the dict shares the module's bytes
                    weights[names[i]] = view
            tensors.append(tensor)
        return GGUFLinear(tensors, bias)

    embed_name = "model.embed_tokens.weight"
    embed = weights[embed_name] = tile_blocks(weights[embed_name])
    head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
    # setattr: the model's attributes are typed as the plain modules this swaps out.
    if is_packed(embed):
        setattr(llama, "embed_tokens", GGUFEmbedding(embed))  # noqa: B010
        swapped["Embedding"] += 1
    if is_packed(head):
        if not cfg.tie_word_embeddings:
            head = weights["lm_head.weight"] = tile_blocks(head)
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

