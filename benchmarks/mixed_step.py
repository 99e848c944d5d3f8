"""Engine step times of mixed steps: the module forward vs the one-call path (decode_layers),
and how well the step-time model (stepcost.py) fits each.

Builds a ``ModelRunner`` on the bundled GGUF with packed weights and times
``runner.execute`` on the calibration's synthetic batches (``engine/calibrate._batch``:
``decodes`` sequences of context ``ctx`` decoding, plus one prefill chunk of ``chunk``
tokens after ``start``). Three ways to run each step, interleaved round by round so a noisy
neighbour hits all alike; the best of the rounds is kept (``--stat median`` for the median):
on a shared machine the best run is the least disturbed one.

- ``module``: the module forward for every step (``runner.decode_graph = None``);
- ``decode-only``: the one-call path for decode-only steps only (the engine before mixed
  steps ran there);
- ``one-call``: the one-call path wherever ``CpuDecodeGraph.supports`` accepts the step.

``--fit`` then seeds a ``StepTimeModel`` on the calibration plan's shapes, timed the same
way, and prints its prediction for every shape against the measured time, for
``decode-only`` and ``one-call``.

    python benchmarks/mixed_step.py                 # the five shapes of notes/cpu_kernels.md
    python benchmarks/mixed_step.py --fit --rounds 7 --clock cpu
    python benchmarks/mixed_step.py --shapes 1,64,16,0 1,64,0,0 --rounds 61
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import typing
from collections.abc import Callable

import torch

from tailserve.config import DtypeChoice, EngineArgs
from tailserve.data.step import SchedulerOutput
from tailserve.engine.calibrate import PLAN, _batch
from tailserve.model.cpu_decode import CpuDecodeGraph
from tailserve.model.device import detect_platform
from tailserve.model.loader import load_model
from tailserve.model.runner import ModelRunner
from tailserve.stepcost import StepShape, StepTimeModel, solve_nonneg

SHAPES = ((1, 64, 16, 0), (4, 256, 64, 0), (16, 256, 32, 0), (16, 256, 128, 0), (0, 0, 128, 0))
# Held out of the calibration plan: decode-only and mixed steps the scheduler makes.
EXTRA = ((16, 256, 0, 0), (32, 512, 0, 0), (4, 64, 0, 0), (1, 64, 16, 0), (16, 256, 32, 0),
         (16, 256, 128, 0), (8, 256, 96, 500), (0, 0, 8, 0))
MODES = ("module", "decode-only", "one-call")


def build(gguf_weights: str, kv_cache_dtype: DtypeChoice | None = None
          ) -> tuple[ModelRunner, int]:
    path = EngineArgs().model
    loaded = load_model(path, gguf_weights=gguf_weights)
    args = EngineArgs(model=path, device="cpu", num_kv_blocks=2048, max_model_len=2048)
    if kv_cache_dtype is not None:  # else EngineArgs' own default
        args = dataclasses.replace(args, kv_cache_dtype=kv_cache_dtype)
    config = args.resolve(loaded.config, detect_platform())
    runner = ModelRunner(config.model, config.runner, config.scheduler.max_model_len,
                         loaded.weights)
    runner.allocate_kv_cache(config.cache)
    return runner, config.cache.block_size


def timer(runner: ModelRunner, graph: CpuDecodeGraph | None, clock: Callable[[], float]
          ) -> Callable[[str, SchedulerOutput], float]:
    def run(mode: str, sched: SchedulerOutput) -> float:
        has_chunk = sched.num_prefill_tokens > 0
        use = mode == "one-call" or (mode == "decode-only" and not has_chunk)
        runner.decode_graph = graph if use else None
        t0 = clock()
        runner.execute(sched)
        return clock() - t0
    return run


def measure(runner: ModelRunner, block_size: int, shapes: tuple[tuple[int, int, int, int], ...],
            rounds: int, stat: Callable[[list[float]], float],
            clock: Callable[[], float] = time.perf_counter,
            ) -> dict[tuple[int, int, int, int], dict[str, float]]:
    graph = runner.decode_graph
    run = timer(runner, graph, clock)
    batches = {s: _batch(*s, block_size, runner.num_kv_blocks) for s in shapes}
    times: dict[tuple[int, int, int, int], dict[str, list[float]]] = {
        s: {m: [] for m in MODES} for s in shapes}
    for b in batches.values():  # warm-up: oneDNN's and the allocator's first shapes
        assert b is not None
        for m in MODES:
            run(m, b)
    for _ in range(rounds):
        for s, b in batches.items():
            assert b is not None
            for m in MODES:
                times[s][m].append(run(m, b))
    runner.decode_graph = graph
    return {s: {m: stat(v) for m, v in d.items()} for s, d in times.items()}


def shape_of(s: tuple[int, int, int, int]) -> StepShape:
    decodes, ctx, chunk, start = s
    return StepShape(chunk, decodes, decodes * ctx, chunk * start + chunk * (chunk + 1) // 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--gguf-weights", default="packed")
    ap.add_argument("--kv-cache-dtype", choices=typing.get_args(DtypeChoice),
                    help="the KV pool (default: EngineArgs', the compute dtype)")
    ap.add_argument("--stat", choices=("min", "median"), default="min")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time, less disturbed by other processes")
    ap.add_argument("--fit", action="store_true", help="also the step-time model's errors")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="decodes,ctx,chunk,start each (default: the five of "
                    "benchmarks/notes/cpu_kernels.md)")
    args = ap.parse_args()
    runner, block_size = build(args.gguf_weights, args.kv_cache_dtype)
    graph = runner.decode_graph
    limit = ("off" if graph is None else "on, any token count" if graph.max_tokens is None
             else f"on, up to {graph.max_tokens} tokens")
    print(f"threads {torch.get_num_threads()}, one-call path {limit}")
    timed = SHAPES if args.shapes is None else tuple(
        typing.cast(tuple[int, int, int, int], tuple(int(v) for v in a.split(",")))
        for a in args.shapes)
    shapes = timed if not args.fit else tuple(dict.fromkeys(timed + PLAN + EXTRA))
    med = measure(runner, block_size, shapes, args.rounds,
                  min if args.stat == "min" else statistics.median,
                  time.perf_counter if args.clock == "wall" else time.process_time)
    print(f"{args.stat} of {args.rounds} rounds, {args.clock} clock")
    print(f"{'(decodes, ctx, chunk, start)':30} {'module':>9} {'one-call':>9} {'saved':>7}")
    for s in timed:
        m, o = med[s]["module"], med[s]["one-call"]
        print(f"{s!s:30} {m * 1e3:8.1f}ms {o * 1e3:8.1f}ms {(m - o) * 1e3:6.1f}ms")
    if not args.fit:
        return
    every = tuple(dict.fromkeys(PLAN + EXTRA))
    for mode in ("decode-only", "one-call"):
        model = StepTimeModel()
        model.seed([shape_of(s) for s in PLAN], [med[s][mode] for s in PLAN])
        print(f"\nstep-time model seeded on the calibration plan, {mode}: "
              + ", ".join(f"{k}={v:.3g}" for k, v in model.describe().items()))
        for s in every:
            pred, got = model.predict(shape_of(s)), med[s][mode]
            tag = "" if s in PLAN else "  (held out)"
            print(f"  {s!s:24} measured {got * 1e3:7.1f} ms  predicted {pred * 1e3:7.1f} ms"
                  f"  {(pred - got) / got * 100:+6.0f}%{tag}")
        # The same fit with one more 0/1 column: does a step-kind indicator explain the rest?
        for name, extra in INDICATORS.items():
            errs = fit_errors(PLAN, every, [med[s][mode] for s in PLAN],
                              [med[s][mode] for s in every], extra)
            decode_only = [e for s, e in zip(every, errs, strict=True) if not s[2]]
            print(f"  {name:42} mean |error| {statistics.mean(errs) * 100:4.0f}%, "
                  f"decode-only steps {statistics.mean(decode_only) * 100:4.0f}%")


# Candidate step-kind features, 0/1 per (decodes, ctx, chunk, start).
INDICATORS: dict[str, Callable[[tuple[int, int, int, int]], float] | None] = {
    "features as they are": None,
    "+ has a prefill chunk": lambda s: float(s[2] > 0),
    "+ more than 8 rows (quant_linear panels)": lambda s: float(s[0] + s[2] > 8),
    "+ min(rows, 16) / 16": lambda s: min(s[0] + s[2], 16) / 16,
    "+ min(rows, 32) / 32": lambda s: min(s[0] + s[2], 32) / 32,
}


def fit_errors(fit_on: tuple[tuple[int, int, int, int], ...],
               every: tuple[tuple[int, int, int, int], ...], fit_times: list[float],
               times: list[float], extra: Callable[[tuple[int, int, int, int]], float] | None
               ) -> list[float]:
    def row(s: tuple[int, int, int, int]) -> list[float]:
        return shape_of(s).row() + ([extra(s)] if extra else [])
    rows = [row(s) for s in fit_on]
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) + (1e-9 if i == j else 0.0) for j in range(n)]
         for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(rows, fit_times, strict=True)) for i in range(n)]
    coef = solve_nonneg(a, b)
    return [abs(sum(c * x for c, x in zip(coef, row(s), strict=True)) - t) / t
            for s, t in zip(every, times, strict=True)]

if __name__ == "__main__":
    main()
