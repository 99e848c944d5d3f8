"""The step-time model's families of ``/metrics`` (``stepcost.py``; docs/slo.md): its prediction
of each step, made before the step ran, next to the measured ``engine_step_seconds``
(rate(abs_error) / rate(engine_step_seconds_sum) is its mean relative error); its coefficients,
the ITL target, the tightest decode's slack, the cap on a step without decodes and the
arrival rate behind it in force after the latest step, as gauges.

The gauges keep only the newest step's values and are set when the page renders (``flush``):
a scrape reads only the last ones, and setting them on every step cost the API process CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from tailserve.data.step import StepStats


class StepModelMetrics:
    def __init__(self, gauge: Callable[..., Gauge], counter: Callable[[str, str], Counter],
                 histogram: Callable[[str, str, tuple[float, ...]], Histogram],
                 buckets: tuple[float, ...]) -> None:
        self.engine_step_predicted_seconds = histogram(
            "engine_step_predicted_seconds", "The step-time model's prediction of each step.",
            buckets,
        )
        self.step_time_prediction_abs_error = counter(
            "step_time_prediction_abs_error_seconds_total",
            "Sum over steps of |measured - predicted| step time.",
        )
        self.step_time_model = gauge(
            "step_time_model", "The step-time model's coefficients after the latest step "
            "(term: base_ms, ms_per_1k_prefill_tokens, ms_per_10_decode_seqs, "
            "ms_per_10k_context_tokens, ms_per_1m_attention_pairs, scale, residual_sigma_ms).",
            ("term",),
        )
        self.itl_target_seconds = gauge(
            "itl_target_seconds", "The time budget of the latest step with decodes: their "
            "smallest slack under the ITL SLO less the margin (0: none)."
        )
        self.min_decode_slack_seconds = gauge(
            "min_decode_slack_seconds", "The slack of the tightest running decode at the latest "
            "step with decodes (its next token's deadline - the step's start; < 0: late).")
        self.prefill_step_cap_seconds = gauge(
            "prefill_step_cap_seconds", "The most a step without decodes may take after the "
            "latest step: the ITL SLO's cap, or longer where few arrive while the engine works "
            "(0: steps not sized by time).")
        self.busy_arrival_rate = gauge(
            "busy_arrival_rate", "Requests that arrived while the engine was working, per "
            "second of its work, decayed over ~30 s (with a prior of 1): a step without "
            "decodes may take 0.02 / this (step_time.ARRIVAL_RISK).")
        # The newest step's gauge values, until the next flush.
        self._step_model: Mapping[str, float] | None = None
        self._cap: tuple[float, float] | None = None
        self._itl_target_s = 0.0
        self._min_slack_s: float | None = None

    def on_step(self, stats: StepStats) -> None:
        if stats.predicted_s is not None:
            self.engine_step_predicted_seconds.observe(stats.predicted_s)
            self.step_time_prediction_abs_error.inc(abs(stats.step_s - stats.predicted_s))
        self._step_model = stats.step_model
        self._itl_target_s = stats.itl_target_s or 0.0
        if stats.min_decode_slack_s is not None:
            self._min_slack_s = stats.min_decode_slack_s
        if stats.busy_arrival_rate is not None:
            self._cap = (stats.prefill_step_cap_s or 0.0, stats.busy_arrival_rate)

    def flush(self) -> None:
        """The newest step's values onto the gauges."""
        if self._step_model is not None:
            for term, value in self._step_model.items():
                self.step_time_model.labels(term=term).set(value)
            self.itl_target_seconds.set(self._itl_target_s)
            self._step_model = None
        if self._min_slack_s is not None:
            self.min_decode_slack_seconds.set(self._min_slack_s)
            self._min_slack_s = None
        if self._cap is not None:
            self.prefill_step_cap_seconds.set(self._cap[0])
            self.busy_arrival_rate.set(self._cap[1])
            self._cap = None
