"""What an engine family exposes, as diagnose's signals.

An :class:`Engine` names the family (for headers and advice), maps the engine's own
``/metrics`` names onto engine-neutral *signals* (``waiting``, ``kv_usage``, ``preemptions``,
the queue-time histogram's sum and count, ...), says which signal each cause rests on, lists
the causes it cannot show with what would let them be judged, and gives advice in its own
flags. The families are declared in the modules beside this one (one per family) and listed
in ``engines/__init__.py``; a family is one more module and one more line there.

:class:`Series` turns the bench's ``/metrics`` samples (taken once a second or so) into
values at each sample and, for counters and histograms, per-window deltas: the increase from
one sample to the next, which is what a counter means (its absolute value counts everything
since the server started, other runs included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Every engine's cpu_contention rests on the host, not on the engine (analyze/contention.py).
CONTENTION_BASIS = ("the CPU the server's host gave to other processes (bench on the server's "
                    "host reads /proc: the host's busy time less the server's process tree "
                    "and the client's)")

# How a metric is read: a gauge's value at the sample, or a counter's increase since the
# previous sample (histogram ``_sum`` / ``_count`` series are counters too).
GAUGE, COUNTER, FRACTION = "gauge", "counter", "fraction"


@dataclass(frozen=True)
class Signal:
    metric: str  # the full name, prefix included (``vllm:num_preemptions_total``)
    kind: str  # GAUGE (summed over label sets), FRACTION (0-1, averaged), COUNTER


@dataclass(frozen=True)
class Engine:
    family: str  # "tailserve", "vllm", "sglang", "llama.cpp", "other"
    name: str  # as a person writes it: "vLLM", "llama-server"
    prefix: str  # its /metrics prefix ("" when none)
    signals: dict[str, Signal] = field(default_factory=dict)
    # cause -> the signal it rests on, as a phrase ("vllm:num_preemptions_total deltas")
    basis: dict[str, str] = field(default_factory=dict)
    # cause -> why this engine cannot show it, and what would let it be judged
    missing: dict[str, str] = field(default_factory=dict)
    # cause -> one sentence of advice in the engine's own flags
    advice: dict[str, str] = field(default_factory=dict)
    # owned_by values of /v1/models that name this family (a fallback when /metrics is off)
    owned_by: tuple[str, ...] = ()

    def judges(self, cause: str) -> bool:
        return cause not in self.missing

    def label(self, version: str | None) -> str:
        """``vLLM 0.32.0``; the family's name alone when the version is unknown."""
        return f"{self.name} {version}" if version else self.name

    def as_json(self) -> dict[str, Any]:
        return {"family": self.family, "name": self.name, "basis": self.basis,
                "cannot_show": self.missing}


@dataclass
class Series:
    """/metrics samples as arrays over sample times ``t`` (wall clock, sorted).

    ``value[s][i]`` is signal ``s`` at sample ``i`` (NaN where the sample lacked it);
    ``delta[s][i]`` is a counter's increase over (t[i-1], t[i]] (0 at i = 0; a counter that
    went down, a restarted server, counts from 0 again).
    """

    t: np.ndarray
    value: dict[str, np.ndarray]
    delta: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.t)

    def has(self, name: str) -> bool:
        v = self.value.get(name)
        return v is not None and bool((~np.isnan(v)).any())

    def interval_mean(self, name: str) -> np.ndarray:
        """A gauge over each interval (t[i-1], t[i]]: the mean of its two ends (NaN: unknown)."""
        v = self.value.get(name, np.full(len(self.t), np.nan))
        prev = np.concatenate([v[:1], v[:-1]])
        return np.where(np.isnan(prev), v, np.where(np.isnan(v), prev, (v + prev) / 2))

    def interval_max(self, name: str) -> np.ndarray:
        """A gauge's larger end over each interval: a momentary dip at one scrape (a request
        just finished and freed its blocks) does not hide a full KV cache."""
        v = self.value.get(name, np.full(len(self.t), np.nan))
        prev = np.concatenate([v[:1], v[:-1]])
        return np.fmax(v, prev)

    def overlap(self, t0: np.ndarray, t1: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """For each span (t0[k], t1[k]], the sum over intervals of ``weight`` times the share
        of the span the interval covers (seconds when ``weight`` is 1 per interval second)."""
        lo = np.concatenate([self.t[:1], self.t[:-1]])
        hi = self.t
        a = np.maximum(np.asarray(t0)[:, None], lo[None, :])
        b = np.minimum(np.asarray(t1)[:, None], hi[None, :])
        return np.asarray((np.clip(b - a, 0.0, None) * weight[None, :]).sum(axis=1))


def _base(key: str) -> str:
    return key.split("{", 1)[0]


def build_series(engine: Engine, samples: list[dict[str, Any]]) -> Series | None:
    """The engine's signals from the bench's samples; None when no sample has any of them."""
    rows = sorted((float(x["t"]), x["values"]) for x in samples
                  if isinstance(x, dict) and isinstance(x.get("values"), dict) and "t" in x)
    if len(rows) < 2 or not engine.signals:
        return None
    by_metric: dict[str, list[str]] = {}
    for name, sig in engine.signals.items():
        by_metric.setdefault(sig.metric, []).append(name)
    n = len(rows)
    value = {name: np.full(n, np.nan) for name in engine.signals}
    for i, (_, vals) in enumerate(rows):
        acc: dict[str, list[float]] = {}
        for key, v in vals.items():
            names = by_metric.get(_base(str(key)), ())
            if not names or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue  # a value that is not a number says nothing; it is not a crash
            for name in names:
                acc.setdefault(name, []).append(float(v))
        for name, xs in acc.items():
            kind = engine.signals[name].kind
            value[name][i] = float(np.mean(xs)) if kind == FRACTION else float(np.sum(xs))
    if all(np.isnan(v).all() for v in value.values()):
        return None
    delta = {}
    for name, sig in engine.signals.items():
        if sig.kind != COUNTER:
            continue
        v = value[name]
        d = np.diff(v, prepend=v[:1])
        # A reset (the server restarted between samples) counts from zero.
        d = np.where(d < 0, v, d)
        delta[name] = np.nan_to_num(d)
    return Series(t=np.array([t for t, _ in rows], dtype=float), value=value, delta=delta)
