"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2, Gemma 3) over
flattened, paged batches. What differs between the families is declared in
``tailserve/families/`` and reaches this file as ``ModelConfig`` fields (``attention_bias``,
``qk_norm``, ``sandwich_norms``, per-layer sliding windows, ...), never as a branch on the
architecture's name.

Read top to bottom: embed -> N x (RMSNorm, attention, RMSNorm, gated MLP) -> RMSNorm -> LM head;
with ``sandwich_norms`` (Gemma) the attention's and the MLP's outputs are normed too before each
residual add.
Inputs are one step's tokens flattened across sequences; attention goes through the
``AttentionBackend`` chosen for the device, so this file never branches on hardware.
"""

from __future__ import annotations

import typing

import torch
from torch import nn

from tailserve.config import ModelConfig
from tailserve.model.attention import AttentionBackend, AttentionMetadata
from tailserve.model.layers import GATED_ACTIVATIONS, ApplyRope, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        # This layer's window (None: it attends to the whole context).
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: one weight read per step instead of three.
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # QK-norm (Qwen3): each head of q and of k normalized over head_dim before rope.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.apply_rope = ApplyRope()
        self.backend = backend

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_tokens = qkv.shape[0]
        # Rope on q and k together: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Over rows of head_dim: [num_tokens * heads, head_dim], a fresh tensor rope may
            # then rotate in place.
            q = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_dim))
            k = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_dim))
            qk = torch.cat([q.view(num_tokens, self.num_heads, self.head_dim),
                            k.view(num_tokens, self.num_kv_heads, self.head_dim)], dim=1)
        qk = self.apply_rope(qk, *rope)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        # [num_tokens, num_heads, head_dim]
        out = self.backend.forward(q, k, v, kv_cache, meta, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(cfg, backend, layer)
        # Without sandwich norms: the pre-MLP norm (fused with the residual add). With them
        # (Gemma): the attention output's norm, and two more around the MLP.
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(h, eps) if cfg.sandwich_norms else None
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it).

        The residual add is deferred into the next RMSNorm (fused with it on CPU), so the
        hidden state after this layer is ``output + residual``.
        """
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta)
        if (self.pre_feedforward_layernorm is not None
                and self.post_feedforward_layernorm is not None):
            h = self.post_attention_layernorm(h)
            h, residual = self.pre_feedforward_layernorm(h, residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope: RotaryEmbedding
        self.local_rope: RotaryEmbedding | None
        self.build_rope(max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers)
        )
        self._local_rope_layers = [cfg.layer_sliding_window(i) is not None
                                   for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def build_rope(self, max_position: int) -> None:
        """The rope tables of positions below ``max_position``, on the current device (made
        again after a meta build). One table; each step looks its positions up once for every
        layer. Gemma 3's sliding layers have their own (another base, no scaling)."""
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.local_rope = (
            RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_local_theta, None)
            if cfg.rope_local_theta is not None and cfg.sliding_window_layers else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """``meta``: the step's, or one per layer (KV cache groups: each group its tables)."""
        metas = meta if isinstance(meta, list) else [meta] * len(kv_caches)
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            x = x * self.config.embedding_scale
        rope = self.rope.lookup(positions)
        local = rope if self.local_rope is None else self.local_rope.lookup(positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache, is_local, layer_meta in zip(
                self.layers, kv_caches, self._local_rope_layers, metas, strict=True):
            x, residual = layer(local if is_local else rope, x, residual, kv_cache, layer_meta)
        if residual is None:  # a model without layers
            return self.norm(x)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that sample reach here: the LM head is the widest matmul of the model.
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as stored here."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights[name]

        # A module apply_gguf_weights swapped in (transforms/gguf_linear.py) holds its weights
        # already: only plain nn.Linear / nn.Embedding are loaded here.
        def plain(module: nn.Module) -> bool:
            return type(module) in (nn.Linear, nn.Embedding)

        if plain(self.embed_tokens):
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if not cfg.tie_word_embeddings and plain(self.lm_head):
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, module in enumerate(self.layers):
            layer = typing.cast(LlamaDecoderLayer, module)
            p = f"model.layers.{i}."
            attn = layer.self_attn
            if plain(attn.qkv_proj):
                attn.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight")
                                                      for n in "qkv"]))
                if cfg.attention_bias:
                    attn.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias")
                                                        for n in "qkv"]))
            if plain(attn.o_proj):
                attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
                attn.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
            if plain(layer.mlp.gate_up_proj):
                layer.mlp.gate_up_proj.weight.copy_(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                )
            if plain(layer.mlp.down_proj):
                layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            for norm, name in ((layer.pre_feedforward_layernorm, "pre_feedforward_layernorm"),
                               (layer.post_feedforward_layernorm, "post_feedforward_layernorm")):
                if norm is not None:
                    norm.weight.copy_(take(p + name + ".weight"))
