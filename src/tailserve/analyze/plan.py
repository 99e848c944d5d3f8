"""``tailserve plan``: what a model needs and what a device gives it, from the config alone.

    weight bytes        every tensor as the loader stores it, counted by the function the
                        runner reports its resident bytes with (model/weight_storage.py): a
                        dtype, --quantization int8/int4's blocks (scales included), or a
                        GGUF's own blocks (--dtype auto on a .gguf: as the CPU loader keeps them)
    KV bytes per token  2 (K and V) x layers x num_key_value_heads x head_dim x bytes
    KV blocks           (device memory x utilization - weights) / (block_size x KV bytes/token)
    max concurrent seqs KV blocks // blocks one sequence of the context needs
    sliding windows     the layers of a window shorter than the context keep only the blocks
                        the window reads (kv_groups.py, as the server lays out its pool): a
                        block is a page of a KV cache group's layers, and one sequence holds
                        every block of the global groups and about window / block_size + 1
                        of each local group
    decode roofline     a decode step reads every weight once and each sequence's KV once;
                        at batch B: step time = (weights + B x context x KV/token) / bandwidth,
                        per-sequence tokens/s = 1 / step time, aggregate = B / step time

KV bytes count the *key-value* heads, not the attention heads: with grouped-query attention
Llama-3-8B keeps 8 KV heads for 32 query heads, 128 KiB per token in bf16, where counting all
heads would claim 512 KiB and a quarter of the real capacity.

The blocks figure leaves out the activation peak of the largest forward pass, which the server
measures at start-up (model/runner.py) and also takes from the budget, so a live server has a
few percent fewer blocks. With tensor parallelism each device holds 1/T of every layer's
weights and of the KV heads, and a whole copy of the embeddings and LM head (replicated, as
tailserve's ranks keep them); T must divide the attention and KV heads (the engine's own check,
``config.check_tensor_parallel``) and the KV figures are ``config.kv_bytes_per_token``, the
function that sizes the server's pool. Communication is ignored.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from tailserve.config import ModelConfig, check_tensor_parallel, kv_bytes_per_token, shard_config
from tailserve.config.model import layer_windows
from tailserve.errors import ConfigError, ModelLoadError
from tailserve.kv_groups import blocks_per_seq, kv_group_layout

GIB = 1 << 30
# Bytes per element, where no loader format says more: fp8 (which tailserve does not load);
# int8 / int4 are --quantization's blocks, counted by weight_storage with their scales.
DTYPE_BYTES: dict[str, float] = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0,
                                 "fp8": 1.0, "int8": 1.0, "int4": 0.5}
WEIGHT_DTYPES = tuple(DTYPE_BYTES)
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
# The roofline's weight formats: 16-bit (fp16 and bf16 read the same bytes), int8, int4, as
# the loader stores them (bfloat16; --quantization int8 / int4).
ROOFLINE_WEIGHTS: dict[str, tuple[str, str | None]] = {
    "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4")}
# Without flags, an 80 GB A100/H100-class device and H100 SXM's HBM3 bandwidth: the most
# common serving GPU. Both are printed as assumptions.
DEFAULT_DEVICE_MEMORY_GIB = 80.0
DEFAULT_BANDWIDTH_GBS = 3350.0


@dataclass(frozen=True)
class PlanInputs:
    model: str | None = None  # folder, config.json or .gguf; None: the bundled default
    device_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    context: int | None = None  # tokens per sequence for concurrency and KV reads; None: max
    dtype: str = "bfloat16"  # auto: a GGUF's own blocks, else bfloat16
    quantization: str | None = None  # int8 / int4 (--dtype int8 / int4 means the same)
    quantization_group_size: int = 32
    kv_dtype: str = "auto"
    block_size: int = 16
    tensor_parallel_size: int = 1
    memory_bandwidth_gbs: float | None = None
    batch: int = 64

    def validate(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_BYTES)} (or auto), "
                              f"got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, "
                              f"got {self.kv_dtype!r}")
        for name, value in (("--block-size", self.block_size), ("--batch", self.batch),
                            ("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--max-model-len", self.max_model_len or 1),
                            ("--context", self.context or 1)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        for name, v in (("--device-memory", self.device_memory_gib),
                        ("--memory-bandwidth", self.memory_bandwidth_gbs)):
            if v is not None and not v > 0:
                raise ConfigError(f"{name} must be > 0, got {v}")


@dataclass
class Plan:
    inputs: dict[str, Any]  # every input, resolved (defaults filled in)
    model_config: dict[str, Any]
    parameter_count: int
    weight_bytes: int  # the whole model at --dtype / --quantization
    weight_bytes_by_format: dict[str, int]  # as the runner reports it (model_weight_bytes)
    weight_bytes_per_device: int
    file_weight_bytes: int | None  # a GGUF's quantized tensors, as stored
    kv_bytes_per_token: int  # the whole model, all devices
    kv_bytes_per_token_per_device: int
    kv_cache_bytes_per_device: int
    num_blocks: int
    kv_tokens: int
    max_concurrent_seqs: int
    max_concurrent_seqs_by_context: dict[int, int]
    decode_tokens_per_s: dict[str, dict[str, float]]
    notes: list[str] = field(default_factory=list)
    # One sequence of the context's KV bytes per device, as the pool holds them (sliding
    # layers: their window only) and were every layer global.
    kv_bytes_per_seq: int = 0
    kv_bytes_per_seq_all_global: int = 0
    kv_group_windows: tuple[int | None, ...] = (None,)  # kv_groups.py

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_concurrent_seqs_by_context"] = {
            str(k): v for k, v in self.max_concurrent_seqs_by_context.items()}
        return out


def load_config(model: str | None) -> tuple[ModelConfig, str, int | None]:
    """(config, the path read, a GGUF's stored tensor bytes). Reads no weights."""
    from tailserve.model.loader import default_model_path

    if model is None:
        path = default_model_path()
    else:
        path = os.path.abspath(os.path.expanduser(model))
        if os.path.isdir(path):
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if os.path.isfile(os.path.join(path, "config.json")):
                path = os.path.join(path, "config.json")
            elif len(ggufs) == 1:
                path = os.path.join(path, ggufs[0])
            else:
                raise ModelLoadError(f"{model}: no config.json and {len(ggufs)} .gguf files; "
                                     "pass the config.json or one .gguf file")
        elif not os.path.isfile(path):
            raise ModelLoadError(f"model path {model!r} does not exist (resolved to {path})")
    if path.endswith(".gguf"):
        from tailserve.model.gguf import gguf_model_config, read_gguf

        # Only the header is parsed; the map's pages of tensor data are never touched.
        f = read_gguf(path)
        return gguf_model_config(f), path, sum(t.nbytes for t in f.tensors.values())
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path} as a config.json: {exc}") from None
    return ModelConfig.from_hf(cfg), path, None


def stored_formats(path: str) -> dict[str, str] | None:
    """A GGUF's tensors the packed loader keeps as blocks (HF name -> format), from its header;
    None for a Hugging Face config."""
    if not path.endswith(".gguf"):
        return None
    from tailserve.model.gguf import packed_storage, read_gguf

    return packed_storage(read_gguf(path))


def weight_storage_bytes(cfg: ModelConfig, inputs: PlanInputs,
                         gguf_types: dict[str, str] | None = None) -> tuple[str, dict[str, int]]:
    """(the weights' format as resolved, bytes per storage format): the loader's count."""
    from tailserve.model.weight_storage import bytes_by_format, check_rtn_shapes, planned_storage

    quantization = inputs.quantization or (
        inputs.dtype if inputs.dtype in ("int8", "int4") else None)
    if quantization is not None:
        if gguf_types is not None:
            raise ConfigError(f"--quantization {quantization} quantizes a float checkpoint; "
                              "this model is a GGUF, quantized already")
        check_rtn_shapes(cfg, quantization, inputs.quantization_group_size)
        return quantization, bytes_by_format(planned_storage(cfg, quantization=quantization))
    if inputs.dtype == "auto" and gguf_types is not None:
        return "gguf", bytes_by_format(planned_storage(cfg, gguf_types=gguf_types))
    dtype = "bfloat16" if inputs.dtype == "auto" else inputs.dtype
    if dtype == "fp8":
        return dtype, {dtype: parameter_count(cfg)}
    return dtype, bytes_by_format(planned_storage(cfg, dtype=dtype))


def parameter_count(cfg: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """Every parameter of a Llama-family decoder (the shapes model/loader.py checks); with
    ``tensor_parallel_size`` T, those one rank holds: 1/T of each layer's projections, whole
    norms, embeddings and LM head (model/transforms/tensor_parallel.py)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    split = (
        h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o projections
        + 3 * h * inter  # gate, up, down
        + ((q_dim + 2 * kv_dim) if cfg.attention_bias else 0)  # Qwen2's q/k/v biases
    )
    per_layer = split // tensor_parallel_size + 2 * h  # + two RMSNorms
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_hidden_layers * per_layer + h  # + the final norm


def make_plan(cfg: ModelConfig, inputs: PlanInputs, path: str = "",
              file_weight_bytes: int | None = None,
              gguf_types: dict[str, str] | None = None) -> Plan:
    inputs.validate()
    if file_weight_bytes is not None and gguf_types is None and path.endswith(".gguf"):
        gguf_types = stored_formats(path)
    notes: list[str] = []
    tp = inputs.tensor_parallel_size
    check_tensor_parallel(cfg, tp)
    mem_gib = inputs.device_memory_gib or DEFAULT_DEVICE_MEMORY_GIB
    bw = inputs.memory_bandwidth_gbs or DEFAULT_BANDWIDTH_GBS
    if inputs.device_memory_gib is None or inputs.memory_bandwidth_gbs is None:
        notes.append(f"assumed device: {mem_gib:g} GiB, {bw:g} GB/s (an 80 GB H100 SXM); "
                     "pass --device-memory and --memory-bandwidth for yours")
    max_len = inputs.max_model_len or cfg.max_position_embeddings
    context = min(inputs.context or max_len, max_len)
    weight_format, by_format = weight_storage_bytes(cfg, inputs, gguf_types)
    kv_dtype = inputs.kv_dtype
    if kv_dtype == "auto":
        # The cache holds activations: integer weight formats still keep a 16-bit cache.
        kv_dtype = weight_format if weight_format in ("float32", "bfloat16", "float16") \
            else "bfloat16"
    kv_elem = DTYPE_BYTES[kv_dtype]
    params = parameter_count(cfg)
    params_dev = parameter_count(cfg, tp)
    weight_bytes = sum(by_format.values())
    # A device's weights, counted as the runner builds a rank's model (config.shard_config):
    # its slices of the layers, the whole embeddings, norms and LM head.
    _, by_format_dev = weight_storage_bytes(shard_config(cfg, tp), inputs, gguf_types)
    weight_dev = sum(by_format_dev.values())
    if tp > 1:
        notes.append(f"each of the {tp} devices also holds the whole embeddings and LM head "
                     f"({(params_dev * tp - params) / (tp - 1) / 1e6:,.1f} M parameters "
                     "replicated)")
    kv_tok = kv_bytes_per_token(cfg, kv_elem)
    kv_tok_dev = kv_bytes_per_token(cfg, kv_elem, tp)
    budget = round(mem_gib * GIB * inputs.gpu_memory_utilization)  # bytes
    kv_cache_dev = max(budget - weight_dev, 0)
    # The server's KV cache groups (none under tensor parallelism, as the engine resolves).
    groups = kv_group_layout(layer_windows(cfg), max_len, release=tp == 1)
    windows = groups.group_windows
    block_bytes = inputs.block_size * kv_bytes_per_token(cfg, kv_elem, tp,
                                                         groups.layers_per_block)
    num_blocks = kv_cache_dev // block_bytes
    usable = max(num_blocks - (1 if groups.releases else 0), 0)  # less the null block
    if groups.releases:
        notes.append(
            f"{len(cfg.sliding_window_layers)} of {cfg.num_hidden_layers} layers attend "
            f"within a window of {cfg.sliding_window:,} tokens and keep only its blocks: KV "
            f"cache groups {['global' if w is None else w for w in windows]}, blocks of "
            f"{groups.layers_per_block} layers")
    if num_blocks == 0:
        notes.append(f"the weights ({weight_dev / GIB:.2f} GiB per device) leave no room for "
                     f"a KV cache in {mem_gib:g} GiB x {inputs.gpu_memory_utilization:g}")

    def seqs_at(tokens: int) -> int:
        return usable // blocks_per_seq(windows, tokens, inputs.block_size)

    contexts = sorted({c for c in (1024, 4096, 32768) if c < max_len} | {context, max_len})
    max_seqs = seqs_at(context)
    if inputs.batch > max_seqs:
        notes.append(f"batch {inputs.batch} needs more KV than fits: at most {max_seqs} "
                     f"sequences of {context} tokens; the roofline is what the bandwidth "
                     "would allow")
    decode = {}
    for name, (dtype, quant) in ROOFLINE_WEIGHTS.items():
        _, read = weight_storage_bytes(shard_config(cfg, tp),
                                       PlanInputs(dtype=dtype, quantization=quant))
        weights_read = sum(read.values())  # bytes per device per step
        kv_read = context * kv_tok_dev  # one sequence's cache, per device

        def step_s(batch: int, weights_read: float = weights_read, kv_read: int = kv_read
                   ) -> float:
            return (weights_read + batch * kv_read) / (bw * 1e9)

        decode[name] = {"batch_1": 1.0 / step_s(1),
                        "per_seq": 1.0 / step_s(inputs.batch),
                        "aggregate": inputs.batch / step_s(inputs.batch)}
    if file_weight_bytes is not None and weight_format == "gguf":
        notes.append(f"the GGUF's blocks as stored ({file_weight_bytes / GIB:.2f} GiB in the "
                     "file), as the CPU kernels serve them; a GPU dequantizes them: pass --dtype")
    elif file_weight_bytes is not None:
        notes.append(f"the GGUF stores {file_weight_bytes / GIB:.2f} GiB of quantized "
                     f"weights; tailserve dequantizes them to {weight_format} when it loads")
    resolved = {**asdict(inputs), "model": path or inputs.model, "device_memory_gib": mem_gib,
                "memory_bandwidth_gbs": bw, "max_model_len": max_len, "context": context,
                "kv_dtype": kv_dtype, "dtype": weight_format}
    mc = {k: getattr(cfg, k) for k in (
        "architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_size", "intermediate_size", "vocab_size", "tie_word_embeddings",
        "attention_bias", "max_position_embeddings")}
    return Plan(
        inputs=resolved, model_config=mc, parameter_count=params, weight_bytes=weight_bytes,
        weight_bytes_by_format=by_format,
        weight_bytes_per_device=weight_dev, file_weight_bytes=file_weight_bytes,
        kv_bytes_per_token=kv_tok, kv_bytes_per_token_per_device=kv_tok_dev,
        kv_cache_bytes_per_device=kv_cache_dev, num_blocks=num_blocks,
        kv_tokens=num_blocks * inputs.block_size, max_concurrent_seqs=max_seqs,
        max_concurrent_seqs_by_context={c: seqs_at(c) for c in contexts},
        decode_tokens_per_s=decode, notes=notes,
        kv_bytes_per_seq=blocks_per_seq(windows, context, inputs.block_size) * block_bytes,
        kv_bytes_per_seq_all_global=math.ceil(context / inputs.block_size)
        * inputs.block_size * kv_tok_dev,
        kv_group_windows=windows,
    )


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def render_plan(p: Plan, console: Any) -> None:
    from rich.table import Table

    i, mc = p.inputs, p.model_config
    tp = i["tensor_parallel_size"]
    dev = " per device" if tp > 1 else ""
    t = Table(title=f"{os.path.basename(str(i['model']))}: {mc['architecture']}, "
              f"{mc['num_hidden_layers']} layers, {mc['num_attention_heads']} heads / "
              f"{mc['num_key_value_heads']} KV heads x {mc['head_dim']}",
              show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("parameters", f"{p.parameter_count:,}"),
        (f"weights ({i['dtype']})", _gib(p.weight_bytes)
         + (f" ({_gib(p.weight_bytes_per_device)}{dev})" if tp > 1 else "")),
        *([("  by format", ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in sorted(
            p.weight_bytes_by_format.items(), key=lambda kv: -kv[1])))]
          if len(p.weight_bytes_by_format) > 1 else []),
        (f"KV per token ({i['kv_dtype']})",
         f"{p.kv_bytes_per_token:,} B ({p.kv_bytes_per_token / 1024:,.1f} KiB)"
         + (f" ({p.kv_bytes_per_token_per_device:,} B{dev})" if tp > 1 else "")),
        (f"KV cache{dev}", f"{_gib(p.kv_cache_bytes_per_device)} of "
         f"{i['device_memory_gib']:g} GiB x {i['gpu_memory_utilization']:g}"),
        (f"KV blocks of {i['block_size']}", f"{p.num_blocks:,} ({p.kv_tokens:,} tokens)"),
        (f"KV per seq at {i['context']:,} tokens{dev}", _gib(p.kv_bytes_per_seq)
         + (f" ({p.kv_bytes_per_seq / p.kv_bytes_per_seq_all_global:.0%} of every layer "
            "global)" if p.kv_bytes_per_seq != p.kv_bytes_per_seq_all_global else "")),
    ]
    rows += [(f"max sequences at {c:,} tokens", f"{n:,}")
             for c, n in p.max_concurrent_seqs_by_context.items()]
    for row in rows:
        t.add_row(*row)
    console.print(t)
    r = Table(title=f"decode roofline at {i['memory_bandwidth_gbs']:g} GB/s{dev}, context "
              f"{i['context']:,} tokens", title_justify="left")
    r.add_column("weights", style="bold")
    for col in ("tok/s, batch 1", f"tok/s per seq, batch {i['batch']}",
                f"tok/s total, batch {i['batch']}"):
        r.add_column(col, justify="right")
    for name, d in p.decode_tokens_per_s.items():
        r.add_row("fp16/bf16" if name == "bf16" else name, f"{d['batch_1']:,.1f}",
                  f"{d['per_seq']:,.1f}", f"{d['aggregate']:,.0f}")
    console.print(r)
    for n in p.notes:
        console.print(f"[yellow]note:[/] {n}")
