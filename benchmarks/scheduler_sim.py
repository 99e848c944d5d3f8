"""The real scheduler on a simulated engine: policy trade-offs in seconds, without the noise.

A live run of the mixed workload takes ~4 minutes and moves 10-25% between runs of the same
tree on this shared machine, too much to tell scheduling policies apart. This drives
``engine.scheduler.Scheduler`` itself (its own online step-time model included) against a
fake runner and a fake clock. Each step "takes" what a fixed step-time model says, times
lognormal noise: by default the coefficients and the noise fitted to a live run's timeline
(``--fit-timeline``, a ``tailserve serve --timeline`` JSONL), else the figures measured on this
machine in-server (below). Arrivals, lengths and outputs follow ``serving_peers.py``'s
open-loop workloads (mixed, long-mix), seeded.

Prints, per variant (``LABEL=--flag value ...``, engine flags as ``tailserve serve`` takes
them): TTFT P50 / P99 (and the short requests' apart for long-mix), the engine-side gaps
between a request's tokens (ITL) P50 / P99 and their ratio, and the goodput share.

    python benchmarks/scheduler_sim.py --workload mixed --variant base= \\
        --variant "itl50=--slo-itl-ms 50" --seeds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import shlex
import sys
from dataclasses import dataclass, field

import numpy as np

# The project's src and this folder (serving_peers.py's workloads), however this is loaded.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving_peers import WORKLOADS, Workload
from tailserve.analyze.data import Steps, read_timeline
from tailserve.analyze.plan import load_config
from tailserve.analyze.stepmodel import fit_step_model
from tailserve.cli import add_engine_args, engine_args_from
from tailserve.config import ModelConfig
from tailserve.data.step import RunnerOutput, SchedulerOutput
from tailserve.engine.scheduler import Scheduler
from tailserve.platforms import Platform
from tailserve.request import Request
from tailserve.sampling_params import SamplingParams
from tailserve.stepcost import StepTimeModel

# Fitted (non-negative least squares) to the 3,693 steps of a live mixed run, 2026-12-02
# (tailserve serve on the bundled GGUF, 2 cores, quiet), in seconds per scaled feature
# (stepcost.SCALES): base 5.5 ms, 0.39 ms a prompt token, 3.1 ms per 1k context tokens
# read by decodes, 0.29 ms per 1k attention pairs. Residual: log-sigma 0.20.
MEASURED_COEF = (5.54e-3, 0.390, 0.0, 31.0e-3, 0.295)
MEASURED_SIGMA = 0.20
HOST_S = 0.5e-3


@functools.cache
def bundled_model() -> ModelConfig:
    """The bundled SmolLM2-135M's shape (the GGUF's metadata): the engine configuration
    resolves against it as it would in serve."""
    return load_config(None)[0]


@dataclass
class Trace:
    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)


def fit(timeline: str) -> tuple[tuple[float, ...], float]:
    """The step costs of a live timeline, fitted as ``tailserve diagnose`` fits them (stalls
    left out), and the log-sigma of what the fit leaves."""
    steps = Steps.from_records([r for r in read_timeline(timeline)
                                if r.get("kind") == "step" and r.get("step_s")])
    model = fit_step_model(steps)
    sigma = float(np.std(np.log(steps.step_s / model.predicted)))
    return tuple(float(c) for c in model.coef), sigma


def simulate(w: Workload, flags: list[str], coef: tuple[float, ...], sigma: float,
             seed: int) -> dict[str, Trace]:
    rng = np.random.default_rng(seed)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(flags))
    config = dataclasses.replace(args, device="cpu", dtype="float32").resolve(
        bundled_model(), Platform(cuda_available=False, cpu_kernels=True))
    clock = [0.0]
    s = Scheduler(config.scheduler, config.cache, clock=lambda: clock[0])
    truth = StepTimeModel(coef)
    s.step_model = StepTimeModel(coef)  # the engine seeds it by calibration
    gaps = rng.exponential(1.0 / w.request_rate, w.num_prompts)
    arrivals = np.cumsum(gaps) - gaps[0]
    lo, hi = w.input_len * (1 - w.range_ratio), w.input_len * (1 + w.range_ratio)
    lens = rng.integers(int(lo), int(hi) + 1, w.num_prompts)
    if w.long_share:
        lens[rng.choice(w.num_prompts, round(w.num_prompts * w.long_share), False)] = w.long_len
    traces: dict[str, Trace] = {}
    pending = list(range(w.num_prompts))
    while pending or s.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= clock[0]:
            i = pending.pop(0)
            rid = f"r{i}"
            prompt = [int(t) % 40 + 1 for t in rng.integers(0, 1 << 30, int(lens[i]))]
            traces[rid] = Trace(float(arrivals[i]), int(lens[i]))
            s.add_request(Request(rid, prompt, SamplingParams(max_tokens=w.output_len,
                                                              ignore_eos=True),
                                  arrival_time=float(arrivals[i]), eos_token_ids=(0,)))
        out: SchedulerOutput = s.schedule()
        if not out.scheduled:
            clock[0] = float(arrivals[pending[0]]) if pending else clock[0]
            continue
        took = truth.predict(Scheduler.shape_of(out)) * math.exp(rng.normal(0.0, sigma))
        clock[0] += took + HOST_S
        sampled = {x.request_id: 7 for x in out.scheduled if x.sample}
        for eo in s.update_from_output(out, RunnerOutput(sampled_token_ids=sampled), took):
            traces[eo.request_id].token_times.append(clock[0])
    return traces


def summarize(runs: list[dict[str, Trace]], long_len: int) -> dict[str, float]:
    ttft, short, itl, good = [], [], [], []
    for traces in runs:
        for t in traces.values():
            first = t.token_times[0] - t.arrival
            g = np.diff(t.token_times)
            ttft.append(first)
            if long_len and t.prompt_len < long_len:
                short.append(first)
            itl.extend(g.tolist())
            good.append(first <= 2.0 and (len(g) == 0 or g.max() <= 0.25))
    p = np.percentile
    row = {"ttft_p50_ms": p(ttft, 50) * 1e3, "ttft_p99_ms": p(ttft, 99) * 1e3,
           "itl_p50_ms": p(itl, 50) * 1e3, "itl_p99_ms": p(itl, 99) * 1e3,
           "good_pct": 100.0 * float(np.mean(good))}
    row["itl_ratio"] = row["itl_p99_ms"] / row["itl_p50_ms"]
    if short:
        row["short_ttft_p50_ms"] = p(short, 50) * 1e3
        row["short_ttft_p99_ms"] = p(short, 99) * 1e3
        row["short_ratio"] = row["short_ttft_p99_ms"] / row["short_ttft_p50_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The open-loop workloads of serving_peers.py (the simulation has no concurrency limit).
    open_loop = sorted(n for n, w in WORKLOADS.items() if math.isfinite(w.request_rate))
    ap.add_argument("--workload", choices=open_loop, default="mixed")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS")
    ap.add_argument("--seeds", type=int, default=5, help="runs per variant (P99 over all)")
    ap.add_argument("--fit-timeline", default=None, help="fit the step costs to this timeline")
    ap.add_argument("--sigma", type=float, default=None, help="log-sigma of the step noise")
    a = ap.parse_args()
    coef, sigma = (MEASURED_COEF, MEASURED_SIGMA) if a.fit_timeline is None \
        else fit(a.fit_timeline)
    if a.sigma is not None:
        sigma = a.sigma
    w = WORKLOADS[a.workload]
    print(f"{a.workload}: coef {[round(c, 5) for c in coef]}, noise log-sigma {sigma:.3f}, "
          f"{a.seeds} seeds")
    for spec in a.variant or ["default="]:
        label, _, flags = spec.partition("=")
        runs = [simulate(w, shlex.split(flags), coef, sigma, seed) for seed in range(a.seeds)]
        row = summarize(runs, w.long_len)
        print(f"  {label:14s} " + "  ".join(f"{k} {v:.1f}" if "ratio" not in k else
                                              f"{k} {v:.2f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
