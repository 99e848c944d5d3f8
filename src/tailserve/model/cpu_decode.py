"""A step's decoder layers in one compiled call on CPU: the counterpart of replaying a CUDA graph.

A step runs the same ~10 small ops per layer every time. From Python each op costs a module
call, argument parsing and a dispatch, which adds up to milliseconds per step
(benchmarks/notes/decode.md). ``torch.ops.tailserve.decode_layers`` runs the same kernels in the
same order in C++, so the hidden states are bit-identical to the module forward's
(tests/test_cpu_decode.py). It runs decode-only steps and mixed ones (decode rows, then
prefill chunks, attended as ``CpuKernelAttentionBackend`` does) alike; the names say "decode"
because the path began with decode-only steps ("decode_layers": the decoder layers). A step
whose row count the module forward would give another kernel (float32 panels above
``PANEL_MAX_ROWS`` rows go to oneDNN), and models or dtypes the kernels do not cover, keep the
module forward; ``enforce_eager`` turns this path off.

The graph replaces the module forward only for a model it knows module by module: ``build``
checks every module of the model against ``_MODEL_PARTS`` / ``_LAYER_PARTS`` (exact types) and
refuses, with a logged reason, any it does not know, so a new model feature is never skipped on
the steps it runs while the module forward would run it. Features that are not modules are
checked by name: scaled embeddings refuse the model; a sliding window refuses each step in which
some context is longer than the window (the compiled attention attends to every cached
position), and those steps run the module forward.
"""

from __future__ import annotations

import logging
import re
import typing
from dataclasses import dataclass

import torch
from torch import nn

from tailserve.model.attention import AttentionMetadata
from tailserve.model.attention.cpu_kernels import CpuKernelAttentionBackend
from tailserve.model.layers import RotaryEmbedding
from tailserve.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tailserve.model.transforms import (
    FusedApplyRope,
    FusedRMSNorm,
    FusedSiluAndMul,
    KernelLinear,
    Linear16,
    WideEmbedding,
)
from tailserve.model.transforms.gguf_linear import GGUFEmbedding, GGUFLinear
from tailserve.model.transforms.kernel_linear import PANEL_MAX_ROWS

log = logging.getLogger(__name__)

# What decode_layers knows: every module path of a model it can stand in for (a layer's parts
# relative to ``layers.<i>``) with the exact type whose forward it reproduces. Anything else in
# the model, or another type at one of these paths, is refused. The LM head runs after the
# graph (compute_logits), as after the module forward. A projection is float32 panels
# (KernelLinear), 16-bit ones (Linear16) or GGUF blocks, stored or tiled (GGUFLinear, read by
# quant_linear); decode_layers reads each. The last two run one kernel at every row count;
# KernelLinear runs panel_linear up to PANEL_MAX_ROWS rows only (``max_tokens``).
_LINEAR = (KernelLinear, Linear16, GGUFLinear)
_MODEL_PARTS: dict[str, tuple[type[nn.Module], ...]] = {
    "": (LlamaForCausalLM,),
    "embed_tokens": (nn.Embedding, WideEmbedding, GGUFEmbedding),
    "rope": (RotaryEmbedding,),
    "layers": (nn.ModuleList,),
    "norm": (FusedRMSNorm,),
    "lm_head": _LINEAR,
}
_LAYER_PARTS: dict[str, tuple[type[nn.Module], ...]] = {
    "": (LlamaDecoderLayer,),
    "input_layernorm": (FusedRMSNorm,),
    "self_attn": (LlamaAttention,),
    "self_attn.qkv_proj": _LINEAR,
    "self_attn.apply_rope": (FusedApplyRope,),
    "self_attn.o_proj": _LINEAR,
    "post_attention_layernorm": (FusedRMSNorm,),
    "mlp": (LlamaMLP,),
    "mlp.gate_up_proj": _LINEAR,
    "mlp.act": (FusedSiluAndMul,),
    "mlp.down_proj": _LINEAR,
}
_LAYER_PATH = re.compile(r"layers\.(\d+)(?:\.(.+))?")
_NO_BIAS = torch.empty(0)  # decode_layers reads an empty qkv bias as "none"


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One decoder layer's weights as decode_layers reads them: panels [out/16, in, 16]
    (float32, or 16-bit as ``Linear16`` keeps them), or GGUF blocks (uint8), as stored
    [out, blocks, type_size] or tiled [out/16, blocks, 16, type_size]."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # panels of [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: torch.Tensor  # panels of [hidden, q_size]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # panels of [2 * intermediate, hidden]
    down: torch.Tensor  # panels of [hidden, intermediate]

    def op_args(self) -> list[torch.Tensor]:
        """In the order decode_layers.cpp reads them (kWeightsPerLayer = 7): the one place."""
        bias = self.qkv_bias if self.qkv_bias is not None else _NO_BIAS
        return [self.input_norm, self.qkv, bias, self.o, self.post_attention_norm,
                self.gate_up, self.down]


class _Refused(Exception):
    """A module the graph cannot stand in for; the message names it."""


class CpuDecodeGraph:
    """The decoder layers of a CPU-kernel model, flattened for ``decode_layers``."""

    def __init__(
        self, model: LlamaForCausalLM, layers: list[DecodeLayerWeights], max_tokens: int | None
    ) -> None:
        self.model = model
        self.layers = tuple(layers)
        # The most tokens a step may have here (None: any): where the module forward would
        # switch a projection to another kernel, the two paths would no longer compute the same.
        self.max_tokens = max_tokens
        self.flat_weights = [t for layer in self.layers for t in layer.op_args()]
        self.final_norm = model.norm.weight.detach()
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        # Steps with a context longer than this run the module forward (sliding windows).
        self.window = cfg.sliding_window if cfg.sliding_window_layers else None

    @classmethod
    def build(cls, model: nn.Module) -> CpuDecodeGraph | None:
        """The graph, or None (logged, naming the module) where it cannot stand in for the model.

        That needs every module to be one the graph knows at its place (``apply_cpu_kernels``
        gives the norms, rope and SwiGLU their fused ops and the projections their panel
        copies), and the attention to be the CPU kernel backend: the compiled path calls
        exactly those.
        """
        try:
            _check_modules(model)
            llama = typing.cast(LlamaForCausalLM, model)
            if len(llama.layers) == 0:
                raise _Refused("the model has no decoder layers")
            layers = [_layer_weights(f"layers.{i}", typing.cast(LlamaDecoderLayer, layer))
                      for i, layer in enumerate(llama.layers)]
            if llama.config.embedding_scale is not None:
                raise _Refused(f"the embeddings are scaled (by {llama.config.embedding_scale:g}),"
                               " which it does not do")
            if llama.config.head_dim % 16:
                # CpuKernelAttentionBackend gives such heads to the reference attention.
                raise _Refused(f"head_dim {llama.config.head_dim} is not a multiple of 16, "
                               "which the attention kernels need")
        except _Refused as why:
            log.info("one-call step (decode_layers) off, module forward runs: %s", why)
            return None
        panels = [path for path, m in model.named_modules()
                  if type(m) is KernelLinear and _LAYER_PATH.fullmatch(path)]
        window = llama.config.sliding_window if llama.config.sliding_window_layers else None
        if window is not None:
            log.info("one-call step (decode_layers) on for steps whose contexts fit the sliding "
                     "window of %d tokens: it attends to every cached position, so a step with a "
                     "longer context runs the module forward", window)
        if panels:
            log.info("one-call step (decode_layers) on for steps of up to %d tokens: %s and "
                     "%d more projections are float32 panels, which the module forward gives "
                     "to oneDNN above that", PANEL_MAX_ROWS, panels[0], len(panels) - 1)
        return cls(llama, layers, PANEL_MAX_ROWS if panels else None)

    def supports(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs here: any mix of decodes and prefill chunks, of up to
        ``max_tokens`` tokens (float32 panels: PANEL_MAX_ROWS, where the module forward
        leaves the panel kernel for oneDNN; GGUF blocks and 16-bit panels: any count), none of
        whose contexts is longer than a sliding window of the model."""
        tokens = meta.query_start_loc[-1]
        return (meta.num_seqs > 0 and (self.max_tokens is None or tokens <= self.max_tokens)
                and not meta.window_binds(self.window))

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: decodes first, then prefill chunks
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        model = self.model
        cos, sin = model.rope.lookup(positions)
        starts = meta.query_start_loc_tensor
        if starts is None:
            starts = torch.tensor(meta.query_start_loc, dtype=torch.int64)
        return torch.ops.tailserve.decode_layers(
            model.embed_tokens(input_ids), cos, sin, self.flat_weights, kv_caches,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, starts, meta.num_decodes,
            self.final_norm, self.num_heads, self.eps, meta.scale,
        )


def _check_modules(model: nn.Module) -> None:
    """Every module of the model is in the tables, of exactly the type listed there, and
    none has a forward hook."""
    for path, module in model.named_modules():
        match = _LAYER_PATH.fullmatch(path)
        part = (match.group(2) or "") if match else path
        want = (_LAYER_PARTS if match else _MODEL_PARTS).get(part)
        name = path or "<model>"
        if want is None:
            raise _Refused(f"{name} ({type(module).__name__}) is not a module it knows")
        if type(module) not in want:
            names = " or ".join(w.__name__ for w in want)
            raise _Refused(f"{name} is {type(module).__name__}, not the {names} it runs")
        if module._forward_hooks or module._forward_pre_hooks:  # code the C++ call never runs
            raise _Refused(f"{name} has forward hooks")


def _layer_weights(path: str, layer: LlamaDecoderLayer) -> DecodeLayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn.backend) is not CpuKernelAttentionBackend:
        raise _Refused(f"{path}.self_attn uses {type(attn.backend).__name__}, "
                       "not the CpuKernelAttentionBackend it runs")

    def panel(name: str, module: nn.Module) -> torch.Tensor:
        if type(module) is Linear16:
            linear16 = typing.cast(Linear16, module)
            if not linear16.exact_panels:
                raise _Refused(f"{path}.{name} has padded panels "
                               f"({linear16.out_features} outputs, not a multiple of 16)")
            return linear16.panel
        if type(module) is GGUFLinear:
            packed = typing.cast(GGUFLinear, module).packed
            if packed is None:
                raise _Refused(f"{path}.{name} mixes GGUF formats (one block tensor each)")
            return packed
        linear = typing.cast(KernelLinear, module)
        if linear.panel is None:
            raise _Refused(f"{path}.{name} has no panel copy "
                           f"({linear.out_features} outputs, not a multiple of 16)")
        return linear.panel

    bias = attn.qkv_proj.bias
    return DecodeLayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=panel("self_attn.qkv_proj", attn.qkv_proj),
        qkv_bias=bias.detach() if bias is not None else None,
        o=panel("self_attn.o_proj", attn.o_proj),
        post_attention_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=panel("mlp.gate_up_proj", mlp.gate_up_proj),
        down=panel("mlp.down_proj", mlp.down_proj),
    )
