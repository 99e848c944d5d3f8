"""The families of ``/metrics`` that say what the engine was built as, set once at start-up:
the pool (``vllm:cache_config_info``), the dtypes, the resident weight bytes per storage format,
what each model transform swapped, and the server's SLO.

Values come in plain (obs/ sits below config); each family is an info gauge (value 1, the facts
in its labels) or a gauge of a number the engine resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import Gauge

# vllm:cache_config_info's labels that tailserve knows truthfully; vLLM's others (swap space,
# CPU offload, sliding window, ...) describe features tailserve does not have.
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype")

GaugeFactory = Callable[..., Gauge]  # (name, doc, labels=()) -> a registered Gauge


class ConfigMetrics:
    """``gauge`` makes a ``tailserve:`` gauge, ``vllm_gauge`` a ``vllm:`` one (None: the
    ``vllm:`` families are off)."""

    def __init__(self, gauge: GaugeFactory, vllm_gauge: GaugeFactory | None) -> None:
        self._gauge = gauge
        # vLLM's info gauge: value 1, the configuration in its labels (set by on_cache_config).
        self.cache_config_info = (
            vllm_gauge("cache_config_info", "KV cache configuration (labels; value 1).",
                       CACHE_CONFIG_LABELS)
            if vllm_gauge is not None else None
        )
        self.dtype_info = gauge(
            "dtype_info", "The dtypes the engine stores weights and the KV cache in and computes "
            "activations in (labels; value 1).", ("weight_dtype", "compute_dtype", "cache_dtype"))
        self.model_weight_bytes = gauge(
            "model_weight_bytes", "Resident weight bytes by storage format (Q4_1, Q8_0, "
            "float32: GGUF blocks as stored, float tensors and their kernel copies).", ("format",)
        )
        self.model_transform_swapped_modules = gauge(
            "model_transform_swapped_modules", "Modules each start-up model transform swapped, "
            "by original type (model/build.py; a transform that ran without swapping: "
            "module=\"\", value 0).", ("transform", "module"))
        # Registered by on_slo_config only for the parts the server has.
        self.slo_ttft_seconds: Gauge | None = None
        self.slo_itl_seconds: Gauge | None = None

    def on_weights(self, weight_bytes: Mapping[str, int]) -> None:
        """The model's resident weight bytes per storage format."""
        for fmt, nbytes in weight_bytes.items():
            self.model_weight_bytes.labels(format=fmt).set(nbytes)

    def on_transforms(self, transforms: Mapping[str, Mapping[str, int]]) -> None:
        """The model transforms applied at start-up and what each swapped."""
        for name, swapped in transforms.items():
            for module, count in swapped.items() or [("", 0)]:
                self.model_transform_swapped_modules.labels(transform=name,
                                                            module=module).set(count)

    def on_cache_config(
        self, *, block_size: int, num_kv_blocks: int, enable_prefix_caching: bool,
        cache_dtype: str,
    ) -> None:
        """The resolved pool. ``cache_dtype`` is the dtype the KV cache is stored in; vLLM
        spells the labels as Python ``str()`` of its values, so ``"True"``, not ``"true"``."""
        if self.cache_config_info is None:
            return
        self.cache_config_info.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(num_kv_blocks),
            enable_prefix_caching=str(enable_prefix_caching),
            cache_dtype=cache_dtype,
        ).set(1)

    def on_slo_config(self, *, ttft_s: float | None, itl_s: float | None) -> None:
        """The server's SLO (what a request that brings none is held to); a part that is unset
        has no gauge."""
        if ttft_s is not None:
            self.slo_ttft_seconds = self._gauge(
                "slo_ttft_seconds", "The server's TTFT SLO (--slo-ttft-ms).")
            self.slo_ttft_seconds.set(ttft_s)
        if itl_s is not None:
            self.slo_itl_seconds = self._gauge(
                "slo_itl_seconds", "The server's ITL SLO (--slo-itl-ms).")
            self.slo_itl_seconds.set(itl_s)

    def on_dtypes(self, *, weight_dtype: str, compute_dtype: str, cache_dtype: str) -> None:
        """The resolved dtypes (``RunnerConfig``)."""
        self.dtype_info.labels(weight_dtype=weight_dtype, compute_dtype=compute_dtype,
                               cache_dtype=cache_dtype).set(1)
