"""Prompt speed of two source trees, interleaved in one session: time to first token of a
1,000-token (and a 128-token) prompt through the in-process ``LLM``, as prompt tokens/s.

Each ``--tree LABEL=PATH`` gets one worker process (``PYTHONPATH=PATH/src``, a kernel cache of
its own: the build records absolute paths) that loads the model once, warms up, then times
``LLM.generate`` of one prompt with ``max_tokens=1`` (prefill + the first sample) when the
parent asks. The parent asks the trees in turn, length by length, alternating which goes
first, so a noisy neighbour's load lands on both. Prompts are fresh random token ids every
time and prefix caching is off: no repeat is a cache hit. Engine flags are each tree's
defaults plus ``--engine-arg``s (the same for both).

    python benchmarks/prompt_speed.py --tree today=../wt-base@/tmp/kc-base --tree now=.@/tmp/kc
    python benchmarks/prompt_speed.py --tree a=../a --tree b=. --repeats 9 --lengths 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, random, sys, time
from tailserve import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(None, enable_prefix_caching=False, **args)
vocab = llm.engine.model_config.vocab_size
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
def once(n):
    ids = [rng.randrange(100, vocab) for _ in range(n)]
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, params)
    dt = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == 1
    return dt
for n in (128, 1000, 1000):  # warm-up: kernels, oneDNN primitives, allocator
    once(n)
cfg = llm.engine.config
print(json.dumps({"ready": True, "dtype": cfg.runner.dtype,
                  "budget": cfg.scheduler.max_num_batched_tokens}), flush=True)
for line in sys.stdin:
    print(json.dumps({"s": once(int(line))}), flush=True)
"""


class Worker:
    def __init__(self, label: str, tree: str, engine_args: dict[str, object]) -> None:
        tree, _, cache = tree.partition("@")
        tree = os.path.abspath(tree)
        if not cache:
            cache = os.environ.get("TAILSERVE_KERNEL_CACHE", "/tmp/tailserve-kc") + "-" + label
        env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src"),
               "TAILSERVE_KERNEL_CACHE": cache,
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(engine_args)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = self._read()

    def _read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.label} exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def time(self, n: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return float(self._read()["s"])  # type: ignore[arg-type]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True,
                    help="LABEL=PATH[@KERNEL_CACHE] (2 or more; the first is the baseline; "
                    "default cache: $TAILSERVE_KERNEL_CACHE-LABEL)")
    ap.add_argument("--lengths", default="1000,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=JSON, e.g. "
                    "max_num_batched_tokens=1024 (given to every tree)")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds between timings (idle "
                    "pool threads park)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine_args = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    trees = [t.split("=", 1) for t in args.tree]
    lengths = [int(n) for n in args.lengths.split(",")]
    workers = [Worker(label, path, engine_args) for label, path in trees]
    for w in workers:
        print(f"{w.label}: {w.info}", flush=True)
    times: dict[tuple[str, int], list[float]] = {(w.label, n): [] for w in workers
                                                 for n in lengths}
    try:
        for r in range(args.repeats):
            order = workers if r % 2 == 0 else workers[::-1]
            for n in lengths:
                for w in order:
                    time.sleep(args.pause)
                    times[(w.label, n)].append(w.time(n))
            print(f"round {r + 1}/{args.repeats}: " + "  ".join(
                f"{w.label}@{n} {times[(w.label, n)][-1] * 1e3:.0f} ms"
                for n in lengths for w in workers), flush=True)
    finally:
        for w in workers:
            w.close()
    base = workers[0].label
    print(f"\nmedian of {args.repeats} (first token of one prompt, max_tokens=1):")
    rows = []
    for n in lengths:
        for w in workers:
            ts = times[(w.label, n)]
            med = statistics.median(ts)
            ratio = statistics.median(times[(base, n)]) / med
            rows.append({"tree": w.label, "tokens": n, "median_s": med, "times_s": ts,
                         "prompt_tok_s": n / med, "vs_first": ratio})
            print(f"  {w.label:>8s} {n:5d} tokens: TTFT {med * 1e3:7.1f} ms "
                  f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})  "
                  f"{n / med:7.0f} prompt tok/s  {ratio:.2f}x {base}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
