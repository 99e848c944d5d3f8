"""Where a decode step's time goes, by phase: kernels vs the host code around them.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/step_profile.py --concurrency 1 32

Runs the in-process ``LLM`` (default engine arguments: the bundled GGUF on the compiled
kernels) on ``--concurrency`` greedy requests of ``--prompt-len`` tokens generating
``--output-len`` each, once to warm up and ``--repeats`` times measured, and times every phase
of each decode-only step with ``perf_counter`` wrappers around the methods that do it:

- ``schedule``, ``update`` (scheduler), ``stats`` (``EngineCore._stats``);
- ``prepare`` (runner input staging), ``decode_layers`` (``ModelRunner._forward``: the one-call
  decode), ``lm_head`` (``compute_logits``), ``sample``; ``execute other`` is the rest of
  ``ModelRunner.execute`` (sampling rows, the gather of the sampled rows, inference mode);
- ``output`` (``OutputProcessor.process``: detokenize, stop strings) and ``loop other`` (the
  rest of one ``LLM._run`` iteration).

Prints per-phase medians (ms) and their share of the median iteration; ``--json`` writes them.
A wrapper costs ~1 us, the same in every tree, so two trees compare fairly (the A/B in
benchmarks/notes/renovations.md runs this script from each tree, interleaved). With
``--count-openmp`` it also counts OpenMP parallel regions per decode step (each wakes
OpenMP's sleeping threads under ``OMP_WAIT_POLICY=PASSIVE``): it builds a tiny
``GOMP_parallel`` counter with the system C compiler and re-runs itself under ``LD_PRELOAD``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

PHASES = ["schedule", "prepare", "decode_layers", "lm_head", "sample", "execute other",
          "update", "stats", "output", "loop other"]

_COUNTER_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
static atomic_long regions = 0;
typedef void (*gomp_parallel_t)(void (*)(void*), void*, unsigned, unsigned);
void GOMP_parallel(void (*fn)(void*), void* data, unsigned n, unsigned flags) {
  static gomp_parallel_t real = 0;
  if (!real) real = (gomp_parallel_t)dlsym(RTLD_NEXT, "GOMP_parallel");
  atomic_fetch_add(&regions, 1);
  real(fn, data, n, flags);
}
long tailserve_openmp_regions(void) { return atomic_load(&regions); }
"""


def _openmp_counter() -> Callable[[], int] | None:
    try:
        fn = ctypes.CDLL(None).tailserve_openmp_regions
    except AttributeError:
        return None
    fn.restype = ctypes.c_long
    return lambda: int(fn())


def _rerun_with_counter() -> None:
    folder = tempfile.mkdtemp(prefix="tailserve-omp-")
    src, lib = os.path.join(folder, "count.c"), os.path.join(folder, "libcount.so")
    with open(src, "w") as f:
        f.write(_COUNTER_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src, "-ldl"], check=True)
    env = dict(os.environ, LD_PRELOAD=lib)
    sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--count-openmp", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--model", default=None,
                    help="a GGUF file or HF folder (default: the bundled model)")
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="with --model: a real-size model's 128k context outgrows the pool")
    args = ap.parse_args()
    count = _openmp_counter()
    if args.count_openmp and count is None:
        _rerun_with_counter()

    from tailserve import LLM, SamplingParams  # first: OMP_WAIT_POLICY before torch
    from tailserve.engine import core, output_processor, scheduler
    from tailserve.model import llama, runner, sampler

    times: dict[str, list[float]] = collections.defaultdict(list)
    regions: list[int] = []
    decode_step = [False]

    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                times[label].append(time.perf_counter() - t)

        setattr(owner, name, timed)

    for owner, name, label in [
        (scheduler.Scheduler, "schedule", "schedule"),
        (scheduler.Scheduler, "update_from_output", "update"),
        (core.EngineCore, "_stats", "stats"),
        (runner.ModelRunner, "_prepare", "prepare"),
        (runner.ModelRunner, "_forward", "decode_layers"),
        (runner.ModelRunner, "execute", "execute"),
        (llama.LlamaForCausalLM, "compute_logits", "lm_head"),
        (sampler.Sampler, "__call__", "sample"),
        (output_processor.OutputProcessor, "process", "output"),
    ]:
        wrap(owner, name, label)

    # One LLM._run iteration = one step; keep only decode-only steps' phases.
    rows: list[dict[str, float]] = []
    step = core.EngineCore.step

    def counted_step(self: core.EngineCore) -> Any:
        before = count() if count is not None else 0
        out = step(self)
        if count is not None:
            regions.append(count() - before)
        return out

    core.EngineCore.step = counted_step  # type: ignore[method-assign]
    original_schedule = scheduler.Scheduler.schedule

    def schedule(self: scheduler.Scheduler) -> Any:
        out = original_schedule(self)
        decode_step[0] = bool(out.scheduled) and out.num_prefill_tokens == 0
        return out

    scheduler.Scheduler.schedule = schedule  # type: ignore[method-assign]
    original_process = output_processor.OutputProcessor.process
    loop_start = [0.0]

    def process(self: Any, outputs: Any) -> Any:
        out = original_process(self, outputs)
        now = time.perf_counter()
        if decode_step[0] and loop_start[0]:
            rows.append({k: v[-1] for k, v in times.items()} | {"iteration": now - loop_start[0]})
        loop_start[0] = now
        for v in times.values():
            v.clear()
        return out

    output_processor.OutputProcessor.process = process  # type: ignore[method-assign]

    engine = LLM(args.model, max_model_len=args.max_model_len) if args.model else LLM()
    report: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    for conc in args.concurrency:
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        prompts: list[Any] = [
            {"prompt_token_ids": [(7 * i + j) % 40000 + 100 for j in range(args.prompt_len)]}
            for i in range(conc)
        ]
        engine.generate(prompts, sp)  # warm-up
        rows.clear()
        regions.clear()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            loop_start[0] = 0.0
            engine.generate(prompts, sp)
        wall = time.perf_counter() - t0
        med = {k: statistics.median(r.get(k, 0.0) for r in rows)
               for k in ["iteration", "schedule", "prepare", "decode_layers", "lm_head",
                         "sample", "execute", "update", "stats", "output"]}
        med["execute other"] = statistics.median(
            r["execute"] - r["prepare"] - r["decode_layers"] - r["lm_head"] - r["sample"]
            for r in rows)
        med["loop other"] = statistics.median(
            r["iteration"] - r["schedule"] - r["execute"] - r["update"] - r["stats"] - r["output"]
            for r in rows)
        host = statistics.median(r["iteration"] - r["decode_layers"] - r["lm_head"]
                                 for r in rows)
        entry: dict[str, Any] = {
            "decode_steps": len(rows), "median_ms": {k: v * 1e3 for k, v in med.items()},
            "host_ms": host * 1e3, "tokens_per_s": conc * args.output_len * args.repeats / wall,
        }
        if regions:
            entry["openmp_regions_per_step"] = dict(collections.Counter(regions))
        report[f"concurrency_{conc}"] = entry
        print(f"concurrency {conc}: {len(rows)} decode steps, median iteration "
              f"{med['iteration'] * 1e3:.3f} ms, {entry['tokens_per_s']:.1f} output tok/s")
        for k in PHASES:
            print(f"  {k:14s} {med[k] * 1e3:8.3f} ms  {100 * med[k] / med['iteration']:5.1f}%")
        print(f"  host (not kernels) {host * 1e3:.3f} ms = "
              f"{100 * host / med['iteration']:.1f}% of the iteration")
        if regions:
            print(f"  OpenMP regions per step (all steps): {entry['openmp_regions_per_step']}")
    report["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
