"""What a checkpoint's ``config.json`` asks of the decoder beyond its shape: each such field is
served, or refused by name before any weight is read — never ignored into a wrong answer.

The Llama-family decoder (``model/llama.py``) serves: ``hidden_size`` and the other shape fields,
``head_dim`` (also when it is not hidden / heads), GQA (``num_key_value_heads``),
``attention_bias`` (Qwen2's q/k/v biases), ``tie_word_embeddings``, ``rope_theta``, rope scaling
of the types ``config.SUPPORTED_ROPE_TYPES`` names, and ``sliding_window`` only up to the window:
``EngineArgs`` caps ``max_model_len`` at it (a sequence no longer than the window attends to every
earlier token, exactly as full attention does), because attention past a window is not served yet.

Refused by name (``unsupported_features``): an activation other than SiLU, MLP biases, attention
or final-logit soft-capping, partial rotary embeddings, QK-norm, and attention layer types other
than full and sliding. Ignored, because they cannot change a served token: dropout rates,
``initializer_range``, ``use_cache``, ``pretraining_tp`` (transformers' slicing of the same
products), ``max_window_layers`` without ``use_sliding_window``.
"""

from __future__ import annotations

from typing import Any

from tailserve.errors import ModelLoadError

_LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_features(cfg: dict[str, Any]) -> list[str]:
    """The fields of a Hugging Face ``config.json`` dict whose values the decoder does not
    serve, each as ``name=value``; empty when it serves them all."""
    found = []
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        found.append(f"hidden_act={act!r}")
    if cfg.get("mlp_bias"):
        found.append("mlp_bias=True")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            found.append(f"{key}={cfg[key]!r}")
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
