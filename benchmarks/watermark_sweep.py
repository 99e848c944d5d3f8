"""Watermark sweep: pick the default admission watermark by measurement.

A discrete-event simulation that drives the *real* ``Scheduler`` (and its KV block manager)
with a fake runner on a simulated clock. Only the model is fake; admission, chunked prefill,
preemption by recompute and prefix-cache reuse after preemption are tailserve's own code.

Step time model (seconds), fitted on the real engine or given with ``--step-model a,b,c``::

    step_s = a + b * num_scheduled_tokens + c * num_decode_seqs

Traffic: open-loop Poisson arrivals; prompt lengths 128:0.7, 1024:0.2, 4096:0.1; output
lengths uniform in [64, 512], every request runs to ``max_tokens``. The KV pool is sized so
that KV is the binding constraint (~12 average requests fit; far below ``max_num_seqs``).
Offered loads are fractions of the saturated throughput measured at watermark 0.01 (every
request queued at t=0). Metrics come from the scheduler's own (simulated-clock) timestamps;
recomputed tokens = tokens computed beyond prompt + output - 1 per request.

    python benchmarks/watermark_sweep.py                 # calibrate (~60 s) + sweep
    python benchmarks/watermark_sweep.py --step-model 0.334,0.009261,0.01396   # no torch
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from tailserve.config import CacheConfig, SchedulerConfig
from tailserve.data.step import RunnerOutput, SchedulerOutput
from tailserve.engine.scheduler import Scheduler
from tailserve.request import Request
from tailserve.sampling_params import SamplingParams


def scheduled_tokens(sched: SchedulerOutput) -> int:
    """The step's tokens: its prefill chunks, and one per decoding sequence."""
    return sched.num_prefill_tokens + sched.num_decode_seqs


@dataclass(frozen=True)
class StepModel:
    a: float  # fixed cost per step (s)
    b: float  # per scheduled token (s)
    c: float  # extra per decode sequence (s): attention over its context, sampling

    def __call__(self, sched: SchedulerOutput) -> float:
        return self.a + self.b * scheduled_tokens(sched) + self.c * sched.num_decode_seqs

    def __str__(self) -> str:
        return f"{self.a:.4g},{self.b:.4g},{self.c:.4g}"


# ------------------------------------------------------------------------------ calibration
def calibrate(seconds: float, threads: int | None) -> StepModel:
    """Fit the step model on the real engine (default model, CPU) in waves of ``generate``."""
    import torch

    from tailserve import LLM

    if threads is not None:
        # On a shared 2-core box two OpenMP threads spin against each other and a step's time
        # varies 3x between identical steps; one thread measures the same work steadily.
        torch.set_num_threads(threads)
    t_start = time.monotonic()
    llm = LLM(kv_cache_memory=1.0)
    rng = np.random.default_rng(0)

    def prompt(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": rng.integers(100, 40_000, n).tolist()}

    # (prompt tokens, max_tokens) per request. The waves separate the regressors: pure prefill
    # chunks of several sizes, decode batches of several widths, and mixed steps.
    waves: list[list[tuple[int, int]]] = [
        [(16, 2)],  # warm-up, dropped
        [(512, 1)], [(64, 6)], [(32, 4)] * 8, [(32, 3)] * 32, [(256, 1)], [(32, 4)] * 16,
        [(32, 3)] * 4 + [(384, 2)], [(128, 1)], [(1024, 1)], [(32, 4)] * 8 + [(700, 2)],
    ]
    deadline = t_start + seconds
    for i, wave in enumerate(waves):
        if time.monotonic() > deadline:
            break
        prompts = [prompt(n) for n, _ in wave]
        params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0) for _, m in wave]
        llm.generate(prompts, params)
        if i == 0:
            llm.step_stats.clear()
    stats = list(llm.step_stats)
    x = np.array(
        [[1.0, s.num_prefill_tokens + s.num_decode_seqs, s.num_decode_seqs] for s in stats]
    )
    y = np.array([s.step_s for s in stats])
    del llm  # frees the KV cache before the sweep starts its workers
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b, c = (max(float(v), 0.0) for v in coef)
    resid = y - x @ coef
    print(
        f"calibrated on {len(stats)} steps in {time.monotonic() - t_start:.0f} s "
        f"(torch threads {torch.get_num_threads()}): a={a * 1e3:.2f} ms, "
        f"b={b * 1e3:.3f} ms/token, c={c * 1e3:.3f} ms/decode seq; "
        f"residual RMS {float(np.sqrt(np.mean(resid**2))) * 1e3:.1f} ms "
        f"(mean step {float(y.mean()) * 1e3:.1f} ms)",
        file=sys.stderr,
    )
    return StepModel(a, b, c)


# ------------------------------------------------------------------------------ simulation
@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...] = (128, 1024, 4096)
    prompt_probs: tuple[float, ...] = (0.7, 0.2, 0.1)
    out_min: int = 64
    out_max: int = 512

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        prompts = rng.choice(self.prompt_lens, size=n, p=self.prompt_probs)
        outputs = rng.integers(self.out_min, self.out_max + 1, size=n)
        return prompts, outputs


@dataclass
class RunResult:
    preemptions: int
    recomputed_tokens: int
    useful_tokens: int
    output_tokens: int
    duration_s: float
    ttft: list[float]
    tpot: list[float]
    e2el: list[float]
    max_stall: list[float]  # per request: its longest gap between two output tokens
    preempted_requests: int


class SimClock:
    """Stands in for ``time.monotonic`` inside the scheduler module."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


Config = tuple[SchedulerConfig, CacheConfig]


def make_config(args: argparse.Namespace, watermark: float) -> Config:
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(Workload.prompt_lens) + Workload.out_max,
    )
    # block_bytes only sizes a real pool; the simulation allocates none.
    cache = CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        block_bytes=1, watermark=watermark)
    return sched, cache


def simulate(
    config: Config,
    step_model: StepModel,
    rate: float | None,
    num_requests: int,
    seed: int,
) -> RunResult:
    """Run ``num_requests`` Poisson arrivals at ``rate`` req/s (None: all at t=0) to the end."""
    rng = np.random.default_rng(seed)
    prompt_lens, out_lens = Workload().sample(rng, num_requests)
    if rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    clock = SimClock()
    # The scheduler stamps requests with its clock: the simulated one.
    sched = Scheduler(*config, clock=clock.monotonic)
    requests: list[Request] = []
    next_arrival = 0
    computed_tokens = 0
    last_token_t: dict[str, float] = {}
    max_stall: dict[str, float] = {}
    while next_arrival < num_requests or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            clock.now = max(clock.now, float(arrivals[next_arrival]))
        while next_arrival < num_requests and arrivals[next_arrival] <= clock.now:
            i = next_arrival
            # Distinct random prompts: no prefix sharing between requests, only a preempted
            # request's own freed-but-cached blocks can be hit again.
            prompt = rng.integers(1, 50_000, int(prompt_lens[i])).tolist()
            req = Request(
                str(i), prompt, SamplingParams(max_tokens=int(out_lens[i]), ignore_eos=True),
                arrival_time=float(arrivals[i]),
            )
            sched.add_request(req)
            requests.append(req)
            next_arrival += 1
        out = sched.schedule()
        if not out.scheduled:
            if next_arrival >= num_requests:
                raise RuntimeError("scheduler made no progress with no arrivals left")
            clock.now = float(arrivals[next_arrival])
            continue
        computed_tokens += scheduled_tokens(out)
        step_s = step_model(out)
        clock.now += step_s  # tokens sampled in this step are stamped at its end
        sampled = {s.request_id: 1 for s in out.scheduled if s.sample}
        sched.update_from_output(out, RunnerOutput(sampled_token_ids=sampled), step_s)
        for rid in sampled:
            if rid in last_token_t:
                gap = clock.now - last_token_t[rid]
                max_stall[rid] = max(max_stall.get(rid, 0.0), gap)
            last_token_t[rid] = clock.now

    ttft, tpot, e2el = [], [], []
    useful = 0
    for r in requests:
        ts = r.timestamps
        assert ts.first_token is not None and ts.finished is not None
        ttft.append(ts.first_token - ts.arrival)
        e2el.append(ts.finished - ts.arrival)
        if r.num_output_tokens > 1:
            tpot.append((ts.finished - ts.first_token) / (r.num_output_tokens - 1))
        # Without preemption a request computes its prompt and every output token but the last.
        useful += r.num_prompt_tokens + r.num_output_tokens - 1
    return RunResult(
        preemptions=sched.num_preemptions_total,
        recomputed_tokens=computed_tokens - useful,
        useful_tokens=useful,
        output_tokens=sum(r.num_output_tokens for r in requests),
        duration_s=clock.now - float(arrivals[0]),
        ttft=ttft,
        tpot=tpot,
        e2el=e2el,
        max_stall=[max_stall.get(r.request_id, 0.0) for r in requests],
        preempted_requests=sum(1 for r in requests if r.num_preemptions),
    )


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def fmt_s(v: float) -> str:
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--step-model", help="a,b,c in seconds; default: calibrate on the real engine")
    p.add_argument("--calib-seconds", type=float, default=60.0,
                   help="wall-clock budget of the calibration, model load included")
    p.add_argument("--calib-threads", type=int, default=1, help="torch threads while calibrating")
    p.add_argument("--watermarks", default="0,0.01,0.02,0.05,0.1,0.2")
    p.add_argument("--loads", default="0.6,0.8,0.95",
                   help="offered load as fractions of the saturated rate at watermark 0.01")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=200, help="per run")
    p.add_argument("--num-kv-blocks", type=int, default=768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    return p.parse_args(argv)


Task = tuple[Config, StepModel, float | None, int, int]


def run_task(task: Task) -> RunResult:
    return simulate(*task)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.step_model:
        a, b, c = (float(v) for v in args.step_model.split(","))
        step_model = StepModel(a, b, c)
    else:
        step_model = calibrate(args.calib_seconds, args.calib_threads)
    watermarks = [float(w) for w in args.watermarks.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    seeds = list(range(args.seeds))
    n = args.num_requests
    # spawn, not fork: the calibration may have started torch's thread pool in this process.
    pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        # Saturated rate: every request queued at t=0, so the engine never idles.
        sat_tasks: list[Task] = [
            (make_config(args, 0.01), step_model, None, n, 1000 + s) for s in seeds
        ]
        sat_rate = statistics.mean(n / r.duration_s for r in pool.map(run_task, sat_tasks))
        cells = [(load, wm) for load in loads for wm in watermarks]
        tasks: list[Task] = [
            (make_config(args, wm), step_model, load * sat_rate, n, s)
            for load, wm in cells
            for s in seeds
        ]
        results = list(pool.map(run_task, tasks))

    wl = Workload()
    mean_prompt = sum(n * p for n, p in zip(wl.prompt_lens, wl.prompt_probs, strict=True))
    mean_blocks = (mean_prompt + (wl.out_min + wl.out_max) / 2) / args.block_size
    print(f"step model a,b,c = {step_model}  (s, s/token, s/decode seq)")
    print(
        f"pool {args.num_kv_blocks} blocks x {args.block_size} tokens; a mean request at its end "
        f"holds {mean_blocks:.0f} blocks -> ~{args.num_kv_blocks / mean_blocks:.0f} fit; "
        f"max_num_seqs {args.max_num_seqs}, budget {args.max_num_batched_tokens}; "
        f"saturated rate at watermark 0.01: {sat_rate:.4g} req/s"
    )
    print(
        f"{args.seeds} seeds x {n} requests per cell; latency percentiles pooled over seeds, "
        "counts and throughput are per-run means; stall = a request's longest gap between tokens"
    )
    header = (
        "| load | watermark | preemptions | preempted reqs | recomputed tok (% of useful) "
        "| out tok/s | TTFT P50 s | TTFT P99 s | TPOT P99 ms | stall P99 s | E2EL P99 s |"
    )
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for k, (load, wm) in enumerate(cells):
        runs = results[k * len(seeds) : (k + 1) * len(seeds)]
        ttft = [v for r in runs for v in r.ttft]
        tpot = [v for r in runs for v in r.tpot]
        e2el = [v for r in runs for v in r.e2el]
        stall = [v for r in runs for v in r.max_stall]
        recomp = statistics.mean(r.recomputed_tokens for r in runs)
        recomp_pct = 100 * recomp / statistics.mean(r.useful_tokens for r in runs)
        print(
            f"| {load:.2f} | {wm:g} | {statistics.mean(r.preemptions for r in runs):.1f} "
            f"| {statistics.mean(r.preempted_requests for r in runs):.1f} "
            f"| {recomp:,.0f} ({recomp_pct:.1f}%) "
            f"| {statistics.mean(r.output_tokens / r.duration_s for r in runs):.2f} "
            f"| {fmt_s(pct(ttft, 50))} | {fmt_s(pct(ttft, 99))} "
            f"| {pct(tpot, 99) * 1e3:.0f} | {fmt_s(pct(stall, 99))} | {fmt_s(pct(e2el, 99))} |"
        )
    print(f"\n(took {time.monotonic() - t0:.0f} s wall)", file=sys.stderr)


if __name__ == "__main__":
    main()
