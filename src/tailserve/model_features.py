"""What a checkpoint's ``config.json`` asks of the decoder beyond its shape: each such field is
served, or refused by name before any weight is read — never ignored into a wrong answer.

The Llama-family decoder (``model/llama.py``) serves: ``hidden_size`` and the other shape fields,
``head_dim`` (also when it is not hidden / heads), GQA (``num_key_value_heads``),
``attention_bias`` (Qwen2's q/k/v biases), ``tie_word_embeddings``, ``rope_theta``, rope scaling
of the types ``config.SUPPORTED_ROPE_TYPES`` names, the SiLU and tanh-GELU gated MLPs,
``query_pre_attn_scalar``, ``final_logit_softcapping``, Gemma 3's local rope base
(``rope_local_base_freq`` or ``rope_parameters.sliding_attention``) and sliding windows, per layer
(``sliding_window_layers``). On CUDA attention past a window is not served yet: there
``EngineArgs`` caps ``max_model_len`` at the window (a sequence no longer than the window attends
to every earlier token, exactly as full attention does).

Refused by name (``unsupported_features``): another activation, MLP biases, attention-logit
soft-capping, partial rotary embeddings, QK-norm switches outside a family's declaration,
bidirectional attention, and attention layer types other than full and sliding. Ignored, because
they cannot change a served token: dropout rates, ``initializer_range``, ``use_cache``,
``pretraining_tp`` (transformers' slicing of the same products), ``max_window_layers`` without
``use_sliding_window``.
"""

from __future__ import annotations

from typing import Any

from tailserve.errors import ModelLoadError

_LAYER_TYPES = ("full_attention", "sliding_attention")
# config.json's hidden_act / hidden_activation values the gated MLP serves (model/layers.py).
SERVED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def unsupported_features(cfg: dict[str, Any]) -> list[str]:
    """The fields of a Hugging Face ``config.json`` dict whose values the decoder does not
    serve, each as ``name=value``; empty when it serves them all."""
    found = []
    act = hidden_act(cfg, "silu")
    if act not in SERVED_ACTIVATIONS:
        found.append(f"hidden_act={act!r}")
    if cfg.get("mlp_bias"):
        found.append("mlp_bias=True")
    if cfg.get("attn_logit_softcapping") is not None:
        found.append(f"attn_logit_softcapping={cfg['attn_logit_softcapping']!r}")
    if cfg.get("use_bidirectional_attention"):
        found.append("use_bidirectional_attention=True")
    rope_params = cfg.get("rope_parameters")
    partial = cfg.get("partial_rotary_factor")
    if partial is None and isinstance(rope_params, dict):
        partial = rope_params.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        found.append(f"partial_rotary_factor={partial!r}")
    for key in ("qk_norm", "use_qk_norm"):
        if cfg.get(key):
            found.append(f"{key}={cfg[key]!r}")
    other = sorted({t for t in cfg.get("layer_types") or () if t not in _LAYER_TYPES})
    if other:
        found.append(f"layer_types={other!r}")
    return found


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window (tokens) of the checkpoint's sliding-window layers, or None when
    every layer attends to the whole context.

    Three spellings: ``layer_types`` (transformers >= 4.53 writes it for Qwen2 and the newer
    families: the window applies where a layer says ``sliding_attention``); Qwen2's older
    ``use_sliding_window`` with ``max_window_layers`` (layers from that index on slide; Qwen2
    checkpoints carry a ``sliding_window`` value they do not use, with the switch off); and
    Mistral's bare ``sliding_window`` (every layer slides).
    """
    window = cfg.get("sliding_window")
    if window is None or window is False:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelLoadError(f"sliding_window must be a positive number of tokens, not {window!r}")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return None
        first = cfg.get("max_window_layers")
        if first is not None and first >= cfg.get("num_hidden_layers", 0):
            return None
    return window


def hidden_act(cfg: dict[str, Any], default: str) -> str:
    """The MLP's activation: ``hidden_activation`` (Gemma's spelling, which its configs that
    carry both mean) or ``hidden_act`` (Llama's), else the family's ``default``."""
    return str(cfg.get("hidden_activation", cfg.get("hidden_act", default)))


def sliding_window_layers(cfg: dict[str, Any], default_pattern: int | None = None
                          ) -> tuple[int, ...]:
    """The indices of the layers that attend within ``sliding_window(cfg)``; () when none.

    The spellings of ``sliding_window`` plus Gemma 3's ``sliding_window_pattern`` (every
    pattern-th layer global, the others sliding; ``default_pattern`` is the family's where
    config.json names none: a GGUF never does).
    """
    if sliding_window(cfg) is None:
        return ()
    n = int(cfg.get("num_hidden_layers", 0))
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != n:
            raise ModelLoadError(f"layer_types names {len(layer_types)} layers, but "
                                 f"num_hidden_layers is {n}")
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    pattern = cfg.get("sliding_window_pattern", default_pattern)
    if pattern is not None:
        if not isinstance(pattern, int) or pattern <= 0:
            raise ModelLoadError(f"sliding_window_pattern must be a positive layer count, "
                                 f"not {pattern!r}")
        return tuple(i for i in range(n) if (i + 1) % pattern)
    if cfg.get("use_sliding_window"):  # Qwen2: the layers from max_window_layers on
        return tuple(range(int(cfg.get("max_window_layers") or 0), n))
    return tuple(range(n))
