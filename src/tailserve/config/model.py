"""What the weights are: ``ModelConfig`` read from a checkpoint's config, checked against
what tailserve serves, and the sizes that follow from it (KV bytes per token, a tensor-parallel
rank's shape, the longest sequence the model may serve)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from tailserve.errors import ConfigError, ModelLoadError
from tailserve.families import FAMILIES
from tailserve.kv_groups import KVGroupLayout, kv_group_layout
from tailserve.model_features import (
    hidden_act,
    sliding_window,
    sliding_window_layers,
    unsupported_features,
)

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# freq_factors: llama.cpp's per-dimension divisors of the rope frequencies (a Llama 3.1+
# GGUF's rope_freqs tensor, model/gguf.py), under "freq_factors".
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, independent of where its weights came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Qwen3's RMSNorm over each head of q and k before rope (families/qwen3.py).
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The dtype the checkpoint stores its weights in (config.json's torch_dtype); None where
    # the loader produces float32 (GGUF). ``dtype=auto`` keeps a 16-bit one on CPU.
    checkpoint_dtype: str | None = None
    # The window of the checkpoint's sliding-window layers (None: every layer is global) and
    # which layers slide: a token there attends to the last ``sliding_window`` positions only.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation (model_features.SERVED_ACTIVATIONS)
    # The families' declarations (families/base.py), resolved for this checkpoint.
    sandwich_norms: bool = False
    embedding_scale: float | None = None  # token embeddings times this (Gemma: sqrt(hidden))
    rope_local_theta: float | None = None  # the sliding layers' own rope base (Gemma 3)
    # The attention scale is query_pre_attn_scalar ** -0.5 where set (Gemma), else
    # head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends within, or None where it attends to everything."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    @property
    def attention_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5  # as transformers' Gemma computes
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; unsupported models fail here."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} (model_type={cfg.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = FAMILIES[arch]
        unsupported = unsupported_features(cfg)
        if unsupported:
            raise ModelLoadError(
                f"the {arch} checkpoint asks for what tailserve's decoder does not serve: "
                f"{', '.join(unsupported)}"
            )
        rope_scaling = cfg.get("rope_scaling") or None
        # transformers >= 4.45 nests rope settings under rope_parameters in some exports, and
        # per layer type where the types have their own (Gemma 3).
        rope_params = cfg.get("rope_parameters") or {}
        local_params = rope_params.get("sliding_attention") or {}
        rope_params = rope_params.get("full_attention", rope_params)
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        local_theta = cfg.get("rope_local_base_freq",
                              local_params.get("rope_theta", family.local_rope_theta))
        if local_params.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope scaling on sliding-window layers is not served: "
                                 f"rope_parameters.sliding_attention={local_params!r}")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelLoadError(
                    f"unsupported rope_scaling type {rope_type!r}; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            rope_scaling = {**rope_scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        window_layers = sliding_window_layers(cfg, family.sliding_window_pattern)
        softcap = cfg.get("final_logit_softcapping")
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tie_word_embeddings)),
            attention_bias=bool(cfg.get("attention_bias") if cfg.get("attention_bias")
                                is not None else family.attention_bias),
            qk_norm=family.qk_norm,
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=sliding_window(cfg) if window_layers else None,
            sliding_window_layers=window_layers,
            hidden_act=hidden_act(cfg, family.hidden_act),
            sandwich_norms=family.sandwich_norms,
            embedding_scale=float(hidden) ** 0.5 if family.scale_embeddings else None,
            rope_local_theta=None if local_theta is None else float(local_theta),
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )


DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_tensor_parallel(model: ModelConfig, tensor_parallel_size: int) -> None:
    """Each rank takes whole attention heads, whole KV heads and an equal share of the MLP."""
    tp = tensor_parallel_size
    if tp == 1:
        return
    parts = (("attention heads", model.num_attention_heads),
             ("KV heads", model.num_key_value_heads),
             ("intermediate size", model.intermediate_size))
    bad = [f"{n} {what}" for what, n in parts if n % tp]
    if bad:
        raise ConfigError(
            f"--tensor-parallel-size {tp} does not divide the model's "
            f"{model.num_attention_heads} attention heads and {model.num_key_value_heads} KV "
            f"heads (intermediate size {model.intermediate_size}): {', '.join(bad)} cannot be "
            f"split in {tp}; use a size that divides them"
        )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape of one tensor-parallel rank's model (``check_tensor_parallel`` has to pass):
    heads, KV heads and intermediate size divided by ``world_size``, ``head_dim`` kept. The
    runner builds a rank's model from it, ``tailserve plan`` counts a device's weights by it."""
    check_tensor_parallel(cfg, world_size)
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=cfg.num_key_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
        head_dim=cfg.head_dim,  # explicit already; a rank's hidden // heads would differ
    )


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: float, tensor_parallel_size: int = 1,
                       num_layers: int | None = None) -> int:
    """KV bytes one token takes on one rank: 2 (K and V) x layers x the rank's KV heads x
    head_dim x bytes. The one formula behind the pool's blocks and ``tailserve plan``.
    ``num_layers``: that many layers (a KV cache group's page), not the model's all."""
    heads = math.ceil(model.num_key_value_heads / tensor_parallel_size)
    layers = model.num_hidden_layers if num_layers is None else num_layers
    return int(2 * layers * heads * model.head_dim * dtype_bytes)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: str,
                   tensor_parallel_size: int = 1, kv_groups: KVGroupLayout | None = None) -> int:
    """Bytes of one KV block on one rank: K and V of ``block_size`` tokens in every layer, or
    in the ``layers_per_block`` of a KV cache group's page."""
    layers = None if kv_groups is None else kv_groups.layers_per_block
    return block_size * kv_bytes_per_token(model, DTYPE_BYTES[dtype], tensor_parallel_size,
                                           layers)


def layer_windows(model: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: global)."""
    return [model.layer_sliding_window(i) for i in range(model.num_hidden_layers)]


def resolve_kv_groups(model: ModelConfig, max_model_len: int, device: str,
                      tensor_parallel_size: int = 1) -> KVGroupLayout | None:
    """The KV cache groups (kv_groups.py) where a window shorter than ``max_model_len`` is
    served: its layers then release the blocks it passed. None (one table over every layer)
    elsewhere, and under tensor parallelism (its workers are sent one table per sequence)."""
    if not sliding_window_served(device) or tensor_parallel_size > 1:
        return None
    layout = kv_group_layout(layer_windows(model), max_model_len)
    return layout if layout.releases else None


def sliding_window_served(device: str) -> bool:
    """Whether attention within a sliding window is served on ``device``: by the torch
    reference and the CPU kernels' backends, not yet by the Triton (CUDA) one."""
    return device != "cuda"


def resolve_max_model_len(asked: int | None, model: ModelConfig,
                          window_served: bool = True) -> int:
    """``--max-model-len`` against the model: at most its context length, and, where attention
    within a sliding window is not served (``window_served`` False: CUDA), at most the window.
    Up to the window a sliding-window layer attends to every earlier token, as a global one
    does, so the answers are the checkpoint's own; past it they would silently be another
    model's. Asked for more than the window there: refused; left to default: capped, with a
    warning that says so."""
    limit = model.max_position_embeddings
    if asked is not None and asked > limit:
        raise ConfigError(
            f"max_model_len ({asked}) exceeds the model's context length ({limit})"
        )
    window = model.sliding_window
    if window_served or window is None or window >= (asked or limit):
        return asked or limit
    if asked is not None:
        raise ConfigError(
            f"max_model_len ({asked}) exceeds the model's sliding attention window ({window} "
            f"tokens): attention past the window is not served on this device yet, so a longer "
            f"sequence would get another model's answers; set --max-model-len {window} or less"
        )
    log.warning(
        "the model attends within a sliding window of %d tokens, and attention past the window "
        "is not served on this device yet: max_model_len capped at %d (the model's context "
        "length is %d)", window, window, limit,
    )
    return window
