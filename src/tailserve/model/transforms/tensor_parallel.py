"""Tensor parallelism as a transform: each rank holds a slice of every layer (gpt-fast's tp.py).

Megatron's split of a Llama layer over T ranks, one all-reduce after each half:

    qkv_proj, gate_up_proj   column-parallel: rank r keeps its rows (its heads / its share of
                             the intermediate features); the input is whole on every rank
    o_proj, down_proj        row-parallel: rank r keeps the matching input columns and
                             computes a partial sum, then ``RowParallelLinear`` all-reduces it

so each rank runs attention over ``heads / T`` query heads and ``kv_heads / T`` KV heads, and
its KV pool holds only those (``config.kv_bytes_per_token``). The embeddings, the norms and the
LM head stay whole on every rank (replicated): after each all-reduce the hidden state is the
same on all ranks, so rank 0 alone computes the logits.

Three parts, applied in this order by the runner, *before* the CPU-kernel and 16-bit
transforms, which then wrap the shards like any other ``nn.Linear``:

- ``config.shard_config``: the ``ModelConfig`` one rank's model is built from (heads, KV heads and
  intermediate size divided by T, ``head_dim`` kept), so ``llama.py`` builds the slices'
  shapes without knowing about ranks;
- ``shard_weights``: the checkpoint's Hugging Face-named tensors cut to this rank's slices,
  so ``load_weights`` copies them in as it copies a whole model;
- ``apply_tensor_parallel``: ``o_proj`` / ``down_proj`` wrapped in ``RowParallelLinear``.

Packed GGUF blocks (``[rows, blocks, type_size]``) are cut too: by rows for free, and the
row-parallel projections along their input only on block boundaries (32 values a block for
Q4_0..Q8_0, 256 for the K-quants): a rank's share of the input must be whole blocks, or the
cut is refused with the numbers (load with ``gguf_weights='dequantize'``). The bundled
SmolLM2-135M (Q4_1) splits in 3: o_proj 576 -> 192 inputs (6 blocks), down_proj 1536 -> 512.
The cut is made on the stored form (a tiled tensor, from a dict a runner already used, is
untiled first); each rank's ``apply_gguf_weights`` then tiles its own slices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tailserve.config import ModelConfig, check_tensor_parallel
from tailserve.errors import ConfigError
from tailserve.model.quant.formats import format_of, is_packed, untile_blocks
from tailserve.model.transforms.report import TransformReport

AllReduce = Callable[[torch.Tensor], torch.Tensor]

# Checkpoint names cut by rows (output features) and by columns (input features).
_Q_ROWS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_KV_ROWS = ("self_attn.k_proj.weight", "self_attn.k_proj.bias",
            "self_attn.v_proj.weight", "self_attn.v_proj.bias")
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_COLUMNS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                  world_size: int) -> dict[str, torch.Tensor]:
    """This rank's slices of the checkpoint (views where a slice is contiguous)."""
    check_tensor_parallel(cfg, world_size)
    d = cfg.head_dim
    q_rows = cfg.num_attention_heads // world_size * d
    kv_rows = cfg.num_key_value_heads // world_size * d
    mlp_rows = cfg.intermediate_size // world_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if suffix in _Q_ROWS + _KV_ROWS + _MLP_ROWS + _COLUMNS:
            tensor = untile_blocks(tensor)  # cut by rows and blocks of the stored form
        if suffix in _Q_ROWS:
            out[name] = tensor.narrow(0, rank * q_rows, q_rows)
        elif suffix in _KV_ROWS:
            out[name] = tensor.narrow(0, rank * kv_rows, kv_rows)
        elif suffix in _MLP_ROWS:
            out[name] = tensor.narrow(0, rank * mlp_rows, mlp_rows)
        elif suffix in _COLUMNS:
            # A packed tensor's dim 1 counts blocks: whole blocks per rank, or no cut.
            cols = tensor.shape[1] // world_size
            if is_packed(tensor) and tensor.shape[1] % world_size:
                fmt = format_of(tensor)
                inputs = tensor.shape[1] * fmt.block_size
                raise ConfigError(
                    f"{name}: {inputs} inputs in {fmt.name} blocks of {fmt.block_size} cannot "
                    f"be cut in {world_size} on block boundaries ({inputs // world_size} per "
                    "rank); load with gguf_weights='dequantize'")
            out[name] = tensor.narrow(1, rank * cols, cols).contiguous()
        else:  # embeddings, norms, LM head: whole on every rank
            out[name] = tensor
    return out


class RowParallelLinear(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks.

    ``linear`` is an ordinary projection over this rank's input slice (an ``nn.Linear`` until
    the CPU-kernel transform swaps it); the sum is in place, so the output equals the whole
    projection's on every rank up to the order of the additions."""

    def __init__(self, linear: nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.linear = linear
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.linear(x))


def apply_tensor_parallel(model: nn.Module, all_reduce: AllReduce) -> TransformReport:
    """Wrap every layer's ``o_proj`` and ``down_proj`` (a model built from ``shard_config``
    and loaded with ``shard_weights``) in ``RowParallelLinear``, in place."""
    swapped = 0
    for module in list(model.modules()):
        for child in ("o_proj", "down_proj"):
            inner = getattr(module, child, None)
            if isinstance(inner, nn.Module) and not isinstance(inner, RowParallelLinear):
                setattr(module, child, RowParallelLinear(inner, all_reduce))
                swapped += 1
    return TransformReport(swapped={"RowParallelLinear": swapped} if swapped else {})
