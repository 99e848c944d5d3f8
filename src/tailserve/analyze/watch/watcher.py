"""The watch loop's state: scrape, cut a window, judge it.

``start()`` takes the first scrape and identifies the engine (engines.identify, on the
``/metrics`` names); every ``step()`` takes the next and returns the :class:`Window` between
the two. The caller decides when to step (the CLI every ``--interval`` seconds, a test
after the load it sent has been observed), so nothing here sleeps.

The engine's signals are its adapter's (engines/); tailserve renders vLLM's names under its
own prefix (DESIGN.md), so its signals are vLLM's mapping with the prefix swapped. The TTFT
and ITL histograms are the family's ``time_to_first_token_seconds`` (the adapter's TTFT sum,
less ``_sum``) and ``inter_token_latency_seconds`` (``time_per_output_token_seconds`` on
older vLLM and SGLang).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from tailserve.analyze.counters import kv_bound
from tailserve.analyze.engines import OTHER, Engine, Series, build_series, identify, vllm
from tailserve.analyze.engines.base import Signal
from tailserve.analyze.watch.hist import BucketError, share_at_most, window_delta
from tailserve.analyze.watch.scrape import Fetcher, Scrape, WatchError
from tailserve.analyze.watch.window import (
    BASELINE_WINDOWS,
    LABEL,
    METRICS,
    MetricWindow,
    Window,
    judge_metric,
    name_cause,
)
from tailserve.bench.gpu import GpuWatermark

# Signals whose usual value (the mean over windows that did not jump) a cause is judged against.
_USUAL = ("running", "waiting", "kv_usage", "prompt_tokens_per_s", "prompt_tokens_per_request",
          "queue_mean_s", "prefill_token_share", "step_max_s")


def watch_engine(engine: Engine) -> Engine:
    """The engine with the signals watch reads (tailserve: vLLM's names under its prefix)."""
    if engine.signals or engine.family != "tailserve":
        return engine
    swapped = {k: Signal(engine.prefix + s.metric.removeprefix(vllm.ENGINE.prefix), s.kind)
               for k, s in vllm.ENGINE.signals.items()}
    return dataclasses.replace(engine, signals=swapped)


def histogram_names(engine: Engine) -> dict[str, tuple[str, ...]]:
    ttft = engine.signals.get("ttft_sum")
    first = (ttft.metric.removesuffix("_sum"),) if ttft else ()
    p = engine.prefix
    return {"ttft": tuple(dict.fromkeys((*first, f"{p}time_to_first_token_seconds"))),
            "itl": (f"{p}inter_token_latency_seconds", f"{p}time_per_output_token_seconds")}


class Watcher:
    def __init__(self, fetcher: Fetcher, slos_s: dict[str, float] | None = None,
                 gpu: GpuWatermark | None = None, timeline: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.fetcher = fetcher
        self.slos_s = slos_s or {}
        self.gpu = gpu
        self.use_timeline = timeline
        self.clock = clock
        self.engine: Engine = OTHER
        self.hist_names: dict[str, str] = {}  # metric -> the family this server exports
        self.cannot: dict[str, str] = {}  # metric -> why it cannot be judged
        self.notes: list[str] = []  # degradations, stated once at start
        self.windows: deque[Window] = deque(maxlen=BASELINE_WINDOWS + 1)
        self._scrapes: deque[Scrape] = deque(maxlen=BASELINE_WINDOWS + 2)
        self._first: Scrape | None = None
        self._since: float | None = None  # the timeline's clock at the last read
        self._index = 0

    # ------------------------------------------------------------------ scraping
    def _scrape(self) -> Scrape:
        s = self.fetcher.metrics(self.clock())
        if self._since is not None:
            got = self.fetcher.timeline_steps(self._since)
            if got is not None:
                s.steps = got[0]
                # The newest step read, not the server's clock: a step that ended before
                # "now" can reach the timeline just after it.
                self._since = max((float(r["t"]) for r in s.steps), default=self._since)
        return s

    def start(self) -> Scrape:
        first = self.fetcher.metrics(self.clock())
        names = [k.split("{", 1)[0] for k in first.values] + list(first.hists)
        engine = identify(names)
        if engine is OTHER:
            raise WatchError(f"{self.fetcher.url}/metrics has none of the families watch reads "
                             "(tailserve:, vllm:, sglang:, llamacpp:): an engine it does not "
                             "know, so it can judge nothing")
        self.engine = watch_engine(engine)
        for m, candidates in histogram_names(self.engine).items():
            found = next((h for h in candidates if h in first.hists), None)
            bad = next((first.bad_hists[h] for h in candidates if h in first.bad_hists), None)
            if found is not None:
                self.hist_names[m] = found
            elif bad is not None:
                self.cannot[m] = f"its {LABEL[m]} histogram's buckets cannot be read ({bad})"
            else:
                self.cannot[m] = (f"{self.engine.name} exports no {LABEL[m]} histogram "
                                  f"({candidates[0]})")
        for m, why in self.cannot.items():
            self.notes.append(f"{LABEL[m]}: {why}: its SLO attainment and P99 are not judged")
        if self.use_timeline and self.engine.family == "tailserve":
            got = self.fetcher.timeline_steps(first.t)
            if got is None:
                self.notes.append("no /debug/timeline (or it needs the key): step durations "
                                  "and the prefill share are not read")
            else:
                self._since = got[1]
        if self.gpu is not None and self.gpu.why_not:
            self.notes.append(f"GPU memory: {self.gpu.why_not}")
        self._first = first
        self._scrapes.append(first)
        return first

    def step(self) -> Window:
        if self._first is None:
            raise RuntimeError("start() first")
        prev = self._scrapes[-1]
        now = self._scrape()
        self._scrapes.append(now)
        self._index += 1
        w = Window(self._index, prev.t, now.t, self.engine.name, {}, self._signals(now))
        w.notes = [f"{LABEL[m]}: {why}" for m, why in self.cannot.items()]
        earlier = list(self.windows)
        for m in METRICS:
            name = self.hist_names.get(m)
            if name is None:
                continue
            mw = MetricWindow(m, slo_s=self.slos_s.get(m))
            w.metrics[m] = mw
            try:
                cur = now.hists.get(name)
                if cur is None:
                    raise BucketError("gone from this scrape")
                delta = window_delta(cur, prev.hists.get(name))
                total = window_delta(cur, self._first.hists.get(name))
            except BucketError as exc:
                mw.note = f"{name}: {exc}; this window is not judged"
                continue
            judge_metric(mw, delta, [e.metrics[m] for e in earlier if m in e.metrics])
            if mw.slo_s is not None:
                w.since_start[m] = share_at_most(total, mw.slo_s)
            if mw.jumped:
                name_cause(mw, w.signals, self._usual(earlier))
        if self.gpu is not None:
            w.gpus = self.gpu.read()
        w.memory_gap_bytes = self._memory_gap(now)
        self.windows.append(w)
        return w

    # ------------------------------------------------------------------ signals
    def _series(self) -> Series | None:
        return build_series(self.engine, [{"t": s.t, "values": s.values} for s in self._scrapes])

    def _signals(self, now: Scrape) -> dict[str, float]:
        out: dict[str, float] = {}
        sr = self._series()
        if sr is not None:
            kv_key = next((k for k in ("kv_usage", "kv_usage_old") if sr.has(k)), None)
            for name, arr in (("running", sr.interval_mean("running")),
                              ("waiting", sr.interval_max("waiting")),
                              ("kv_usage", sr.interval_max(kv_key) if kv_key else None)):
                if arr is not None and not np.isnan(arr[-1]):
                    out[name] = float(arr[-1])
            if kv_key is not None:
                out["kv_bound"] = float(kv_bound(sr)[-1])
            d = {k: float(v[-1]) for k, v in sr.delta.items()}
            if "preemptions" in d:
                out["preemptions"] = d["preemptions"]
            span = max(float(sr.t[-1] - sr.t[-2]), 1e-9)
            if "prompt_tokens" in d:
                out["prompt_tokens_per_s"] = d["prompt_tokens"] / span
                if d.get("ttft_count", 0.0) > 0:
                    out["prompt_tokens_per_request"] = d["prompt_tokens"] / d["ttft_count"]
            if d.get("queue_count", 0.0) > 0:
                out["queue_mean_s"] = d["queue_sum"] / d["queue_count"]
                if d.get("ttft_count", 0.0) > 0 and d["ttft_sum"] > 0:
                    ttft_mean = d["ttft_sum"] / d["ttft_count"]
                    out["queue_share"] = out["queue_mean_s"] / ttft_mean
        if now.steps:
            self._step_signals(now.steps, out)
        return out

    @staticmethod
    def _step_signals(steps: list[dict[str, Any]], out: dict[str, float]) -> None:
        """tailserve's timeline: every step, not a scrape's instant."""
        def col(key: str) -> np.ndarray:
            return np.array([float(r.get(key) or 0.0) for r in steps])

        step_s, prefill, decode = col("step_s"), col("num_prefill_tokens"), col("num_decode_seqs")
        out["steps"] = float(len(steps))
        out["step_max_s"] = float(step_s.max())
        out["step_p50_s"] = float(np.median(step_s))
        out["step_p99_s"] = float(np.percentile(step_s, 99))
        tokens = float(prefill.sum() + decode.sum())
        if tokens > 0:
            out["prefill_token_share"] = float(prefill.sum()) / tokens
        out["waiting"] = max(out.get("waiting", 0.0), float(col("num_waiting").max()))
        pre = float(col("num_preemptions").sum())
        out["preemptions"] = max(out.get("preemptions", 0.0), pre)

    def _usual(self, earlier: list[Window]) -> dict[str, float]:
        calm = [w for w in earlier if not w.jumped]
        out = {}
        for k in _USUAL:
            xs = [w.signals[k] for w in calm if k in w.signals]
            if xs:
                out[k] = float(np.mean(xs))
        return out

    def _memory_gap(self, s: Scrape) -> float | None:
        """The caching allocator's reserved less allocated bytes, where the engine exports
        both (tailserve does; vLLM 0.32 exports neither) and reserves any (on CPU it is 0)."""
        p = self.engine.prefix
        res = s.values.get(f"{p}torch_memory_reserved_bytes")
        alloc = s.values.get(f"{p}torch_memory_allocated_bytes")
        return None if res is None or alloc is None or res <= 0 else res - alloc
