"""Configuration, one concept per module:

- ``config.model``: ``ModelConfig`` (what the weights are) and the sizes that follow from it;
- ``config.load``: how the checkpoint is read (``--gguf-weights``, ``--quantization``);
- ``config.args``: ``EngineArgs``, the user's arguments (the CLI's flags, ``LLM(**kwargs)``);
- ``config.engine``: the frozen ``EngineConfig`` they resolve to, and its parts;
- ``config.resolve``: that resolution (``EngineArgs.resolve`` and its ``resolve_*`` steps).

The names are re-exported here so that ``from tailserve.config import EngineArgs`` stays the
one import a caller needs; each is defined in exactly one of the modules above.
"""

from tailserve.config.args import (
    DEFAULT_SLO_ITL_MS,
    DEFAULT_SLO_TTFT_MS,
    MAX_ITL_SLO_MS,
    MAX_TTFT_SLO_MS,
    REMOVED_ENGINE_ARGS,
    DtypeChoice,
    EngineArgs,
    check_removed_args,
    parse_optional_ms,
)
from tailserve.config.engine import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ObservabilityConfig,
    PrefixHashAlgo,
    RunnerConfig,
    SchedulerConfig,
    UnsizedEngineConfig,
    check_pool_fits,
    max_request_tokens,
)
from tailserve.config.load import (
    GGUF_WEIGHTS,
    QUANTIZATIONS,
    RTN_BLOCK,
    LoadConfig,
    check_quantization_group_size,
    check_quantization_supported,
    packed_weights_supported,
    resolve_gguf_weights,
)
from tailserve.config.model import (
    DTYPE_BYTES,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    check_tensor_parallel,
    kv_block_bytes,
    kv_bytes_per_token,
    resolve_max_model_len,
    shard_config,
)
from tailserve.config.resolve import DEFAULT_BATCHED_TOKENS

__all__ = [
    "DEFAULT_BATCHED_TOKENS", "DEFAULT_SLO_ITL_MS", "DEFAULT_SLO_TTFT_MS", "DTYPE_BYTES",
    "GGUF_WEIGHTS", "MAX_ITL_SLO_MS", "MAX_TTFT_SLO_MS", "QUANTIZATIONS", "REMOVED_ENGINE_ARGS",
    "RTN_BLOCK", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "CacheConfig", "DtypeChoice",
    "EngineArgs", "EngineConfig", "KVEventsConfig", "LoadConfig", "ModelConfig",
    "ObservabilityConfig", "PrefixHashAlgo", "RunnerConfig", "SchedulerConfig",
    "UnsizedEngineConfig", "check_pool_fits", "check_quantization_group_size",
    "check_quantization_supported", "check_removed_args", "check_tensor_parallel",
    "kv_block_bytes", "kv_bytes_per_token", "max_request_tokens", "packed_weights_supported",
    "parse_optional_ms", "resolve_gguf_weights", "resolve_max_model_len", "shard_config",
]
