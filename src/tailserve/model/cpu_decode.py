"""Decode-only steps in one compiled call on CPU: the counterpart of replaying a CUDA graph.

When every scheduled sequence decodes one token, a step runs the same ~10 small ops per layer
every time. From Python each op costs a module call, argument parsing and a dispatch, which
adds up to milliseconds per step (benchmarks/RESULTS.md). ``torch.ops.tailserve.decode_layers``
runs the same kernels in the same order in C++, so the hidden states are bit-identical to the
module forward's (tests/test_cpu_decode.py). Steps with a prefill chunk, and models or dtypes
the kernels do not cover, keep the module forward; ``enforce_eager`` turns this path off.
"""

from __future__ import annotations

import typing

import torch

from tailserve.model.attention import AttentionMetadata
from tailserve.model.attention.cpu_kernels import CpuKernelAttentionBackend
from tailserve.model.layers import PANEL_MAX_ROWS
from tailserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM


class CpuDecodeGraph:
    """The decoder layers of a prepared CPU model, flattened for ``decode_layers``."""

    def __init__(self, model: LlamaForCausalLM, weights: list[torch.Tensor]) -> None:
        self.model = model
        self.weights = weights  # 7 per layer, in the order decode_layers.cpp reads them
        self.final_norm = model.norm.weight.detach()
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> CpuDecodeGraph | None:
        """The graph, or None when the model does not run every piece on the CPU kernels.

        That needs ``prepare_cpu_kernels`` to have given every projection a panel copy and the
        norms, rope and SwiGLU their fused ops, and the attention to be the CPU kernel
        backend: the compiled path calls exactly those.
        """
        if len(model.layers) == 0 or not model.norm.use_kernel:
            return None
        weights: list[torch.Tensor] = []
        for module in model.layers:
            layer = typing.cast(LlamaDecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            if not (attn.use_kernel and mlp.act.use_kernel and layer.input_layernorm.use_kernel
                    and layer.post_attention_layernorm.use_kernel
                    and isinstance(attn.backend, CpuKernelAttentionBackend)):
                return None
            panels = [lin.panel for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                            mlp.down_proj)]
            if any(p is None for p in panels):
                return None
            qkv, o, gate_up, down = typing.cast(list[torch.Tensor], panels)
            bias = attn.qkv_proj.bias
            weights += [
                layer.input_layernorm.weight.detach(),
                qkv,
                bias.detach() if bias is not None else torch.empty(0),
                o,
                layer.post_attention_layernorm.weight.detach(),
                gate_up,
                down,
            ]
        return cls(model, weights)

    @staticmethod
    def supports(meta: AttentionMetadata) -> bool:
        """Decode-only steps of up to PANEL_MAX_ROWS sequences: there the module forward runs
        every linear on the panel kernel too, so both paths compute the same."""
        return meta.num_decodes == meta.num_seqs and 0 < meta.num_seqs <= PANEL_MAX_ROWS

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, hidden], after the final norm
        model = self.model
        cos, sin = model.rope.lookup(positions)
        return torch.ops.tailserve.decode_layers(
            model.embed_tokens(input_ids), cos, sin, self.weights, kv_caches,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, self.final_norm,
            self.num_heads, self.eps, meta.scale,
        )
