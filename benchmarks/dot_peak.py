"""The limit a prefill step runs against, measured (issue 30, item 4): this machine's peak rate
of each dot instruction, torch's own rate on prefill-shaped products, and the prefill step's
achieved rate, so each prefill figure is also a fraction of the silicon's peak (as decode
figures are a fraction of the memory roofline, benchmarks/roofline.py).

    python benchmarks/dot_peak.py                       # all three parts
    python benchmarks/dot_peak.py --part silicon --part torch --json out.json
    python benchmarks/dot_peak.py --part prefill --lengths 128,512,2000

- ``silicon``: a register-resident loop of each instruction (16 independent accumulators, no
  memory operand), compiled here with the system C++ compiler at ``-march=native``: int8
  AVX512-VNNI ``vpdpbusd`` (64 multiply-adds = 128 ops per zmm instruction), bf16
  ``vdpbf16ps`` (64 ops), fp32 FMA on zmm and ymm (32 / 16), and AVX2's int8 dot
  (``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``: 64 ops per three instructions). Run on one
  thread pinned to each core, timed by that thread's CPU time (a neighbour that takes the core
  away stops the clock too), then on all cores at once (wall clock); the peak of the machine
  is the sum of the per-core rates (a busy neighbour lowers the all-cores run, not the
  silicon). A CPU
  without one of these instructions skips it (the program is built per instruction).
- ``torch``: the products of SmolLM2-135M's layers (hidden 576, intermediate 1536, 9 heads x 64,
  3 KV heads) at 128 / 512 / 2,048 rows: the packed Q4_1 ``quant_linear`` the runner serves,
  bf16 ``torch.matmul`` (oneDNN), ``torch._int_mm`` (int8 x int8 -> int32) and fp32 matmul.
- ``prefill``: time to first token of one prompt through the in-process ``LLM`` (prefix cache
  off, budget >= the prompt so one step), and its ops: the layers' products (2 x params x
  tokens), the causal attention (QK^T and PV over the triangle) and the LM head of the one
  sampled row.

Rates are ops/s with a multiply-add counted as 2 ops. The machine is shared in the sessions that
run this: say whether it was quiet.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

LOOP = r"""
#include <immintrin.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#define ACC 16
volatile double sink;
static double cpu_s[64];
static double thread_cpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
static void body(long n, int t) {
  const double c0 = thread_cpu();
  KERNEL_INIT
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < ACC; ++i) KERNEL_STEP;
    __asm__ volatile("" : "+v"(a), "+v"(b));  // the operands stay live, unfolded
  }
  double s = 0;
  for (int i = 0; i < ACC; ++i) s += KERNEL_SUM;
  sink = s;
  cpu_s[t] = thread_cpu() - c0;
}
int main(int argc, char** argv) {
  const long iters = atol(argv[1]);
  const int threads = atoi(argv[2]);
  double best = 1e30, best_cpu = 1e30;  // wall seconds; the slowest thread's CPU seconds
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(body, iters, t);
    for (auto& t : pool) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double c = 0;
    for (int t = 0; t < threads; ++t) c = cpu_s[t] > c ? cpu_s[t] : c;
    if (s < best) best = s;
    if (c < best_cpu) best_cpu = c;
  }
  printf("%.9f %.9f\n", best, best_cpu);
}
"""

# name -> (ops per instruction step, compiler flags it needs, init, step, sum)
KERNELS: dict[str, tuple[int, str, str, str, str]] = {
    "int8 vpdpbusd zmm (AVX512-VNNI)": (
        128, "avx512vnni",
        "__m512i acc[ACC]; for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_epi32(i);"
        "__m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);",
        "acc[i] = _mm512_dpbusd_epi32(acc[i], a, b)", "_mm512_reduce_add_epi32(acc[i])"),
    "bf16 vdpbf16ps zmm (AVX512-BF16)": (
        64, "avx512bf16",
        "__m512 acc[ACC]; for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_ps(i);"
        "__m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = a;",
        "acc[i] = _mm512_dpbf16_ps(acc[i], a, b)", "_mm512_reduce_add_ps(acc[i])"),
    "fp32 vfmadd zmm (AVX512F)": (
        32, "avx512f",
        "__m512 acc[ACC]; for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_ps(i);"
        "__m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);",
        "acc[i] = _mm512_fmadd_ps(a, b, acc[i])", "_mm512_reduce_add_ps(acc[i])"),
    "fp32 vfmadd ymm (AVX2)": (
        16, "avx2",
        "__m256 acc[ACC]; for (int i = 0; i < ACC; ++i) acc[i] = _mm256_set1_ps(i);"
        "__m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);",
        "acc[i] = _mm256_fmadd_ps(a, b, acc[i])", "_mm256_cvtss_f32(acc[i])"),
    "int8 vpmaddubsw+vpmaddwd ymm (AVX2)": (
        64, "avx2",
        "__m256i acc[ACC]; for (int i = 0; i < ACC; ++i) acc[i] = _mm256_set1_epi32(i);"
        "__m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), "
        "ones = _mm256_set1_epi16(1);",
        "acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))",
        "_mm256_cvtsi256_si32(acc[i])"),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def silicon(iters: int) -> list[dict[str, object]]:
    from tailserve.kernels import cxx_compiler

    cxx = cxx_compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler: the silicon part needs one")
    flags = _cpu_flags()
    cores = sorted(os.sched_getaffinity(0))
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ops, flag, init, step, total) in KERNELS.items():
            if flag.replace("avx512", "avx512_") not in flags and flag not in flags:
                print(f"{name}: not on this CPU ({flag})", flush=True)
                continue
            src = (LOOP.replace("KERNEL_INIT", init).replace("KERNEL_STEP", step)
                   .replace("KERNEL_SUM", total))
            exe = os.path.join(tmp, flag)
            with open(exe + ".cpp", "w") as f:
                f.write(src)
            subprocess.run([cxx, "-O2", "-march=native", "-pthread", exe + ".cpp", "-o", exe],
                           check=True)
            per_core, per_core_wall = [], []
            for core in cores:
                out = subprocess.run(["taskset", "-c", str(core), exe, str(iters), "1"],
                                     check=True, capture_output=True, text=True).stdout
                wall, cpu = (float(v) for v in out.split())
                per_core.append(iters * 16 * ops / cpu)
                per_core_wall.append(iters * 16 * ops / wall)
            out = subprocess.run([exe, str(iters), str(len(cores))], check=True,
                                 capture_output=True, text=True).stdout
            together = iters * 16 * ops * len(cores) / float(out.split()[0])
            row: dict[str, object] = {"part": "silicon", "kernel": name, "per_core_ops_s": per_core,
                   "per_core_wall_ops_s": per_core_wall, "peak_ops_s": sum(per_core),
                   "all_cores_at_once_ops_s": together}
            rows.append(row)
            print(f"{name:38s} per core {' '.join(f'{r / 1e9:6.0f}' for r in per_core)} "
                  f"GOP/s  peak {sum(per_core) / 1e9:6.0f}  all cores at once "
                  f"{together / 1e9:6.0f}", flush=True)
    return rows + amx_silicon(iters)


def amx_silicon(iters: int) -> list[dict[str, object]]:
    """AMX's tile instructions back to back on registers (the kernels' ``amx_peak``: four
    independent int32 / float32 accumulator tiles), on one thread and on every core at once.
    One TDPBSSD is 16 x 16 dots of 64 int8 pairs (32,768 ops), one TDPBF16PS of 32 bf16 pairs."""
    from tailserve.kernels import cpu_ops_available, isa_info

    if not cpu_ops_available() or isa_info().supported != "amx":
        reason = "no kernels" if not cpu_ops_available() else isa_info().amx_reason
        print(f"AMX tiles: not measured ({reason or 'this build has no tile kernels'})")
        return []
    rows: list[dict[str, object]] = []
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    for bf16, name in ((False, "int8 AMX tdpbssd"), (True, "bf16 AMX tdpbf16ps")):
        n = max(iters // 64, 1 << 16)
        torch.set_num_threads(1)
        one = max(float(torch.ops.tailserve.amx_peak(bf16, n)) for _ in range(3))
        torch.set_num_threads(cores)
        together = max(float(torch.ops.tailserve.amx_peak(bf16, n)) for _ in range(3))
        torch.set_num_threads(threads)
        rows.append({"part": "silicon", "kernel": name, "per_core_ops_s": [one],
                     "peak_ops_s": one * cores, "all_cores_at_once_ops_s": together})
        print(f"{name:38s} one thread {one / 1e9:6.0f} GOP/s  peak {one * cores / 1e9:6.0f}  "
              f"all cores at once {together / 1e9:6.0f}", flush=True)
    return rows


# (N, K) of one layer's products: q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576, down
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def torch_rates(rows_list: list[int], repeats: int) -> list[dict[str, object]]:
    sys.path.insert(0, os.path.dirname(__file__))
    from decode_products import random_blocks
    from roofline import best_seconds  # first call untimed, then the best of `repeats`
    from tailserve.kernels import cpu_ops_available, isa_info, set_quant_isa
    from tailserve.model.quant.formats import tile_blocks

    have_kernels = cpu_ops_available()
    out: list[dict[str, object]] = []
    for m in rows_list:
        for n, k in SHAPES:
            ops = 2 * m * n * k
            x = torch.randn(m, k)
            xb = x.bfloat16()
            wb = torch.randn(n, k).bfloat16()
            wf = wb.float()
            xi = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            wi = torch.randint(-127, 128, (k, n), dtype=torch.int8)
            ways: dict[str, Callable[[], object]] = {
                "bf16 matmul": functools.partial(torch.matmul, xb, wb.t()),
                "torch._int_mm": functools.partial(torch._int_mm, xi, wi),
                "fp32 matmul": functools.partial(torch.matmul, x, wf.t()),
            }
            rates: dict[str, float] = {}
            if have_kernels:  # tiled as the runner serves them (AMX at 16+ rows where usable)
                wq = tile_blocks(random_blocks(n, k, 20))
                info = isa_info()
                levels: list[str | None] = [None]
                if info.supported == "amx":
                    levels = ["amx", "amx-bf16", "avx512vnni"] if info.amx_bf16 else [
                        "amx", "avx512vnni"]
                for level in levels:
                    if level:
                        set_quant_isa(level)
                    fn = functools.partial(torch.ops.tailserve.quant_linear, x, wq, None)
                    rates[f"Q4_1 quant_linear{' ' + level if level else ''}"] = (
                        ops / best_seconds(fn, repeats))
                set_quant_isa("auto")
            rates.update({name: ops / best_seconds(fn, repeats) for name, fn in ways.items()})
            out.append({"part": "torch", "rows": m, "n": n, "k": k, "ops_s": rates})
            print(f"{m:5d} x {n:4d} x {k:4d}  " + "  ".join(
                f"{name} {r / 1e9:5.0f}" for name, r in rates.items()) + "  GOP/s", flush=True)
    return out


def prefill_ops(cfg: object, tokens: int) -> dict[str, float]:
    """Ops of one prompt's prefill in one step (a multiply-add = 2)."""
    h = cfg.hidden_size  # type: ignore[attr-defined]
    inter = cfg.intermediate_size  # type: ignore[attr-defined]
    heads = cfg.num_attention_heads  # type: ignore[attr-defined]
    kv = cfg.num_key_value_heads  # type: ignore[attr-defined]
    hd = cfg.head_dim  # type: ignore[attr-defined]
    layers = cfg.num_hidden_layers  # type: ignore[attr-defined]
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter
    products = 2.0 * per_layer * layers * tokens
    attention = 2.0 * 2 * layers * heads * hd * tokens * (tokens + 1) / 2  # QK^T and PV
    lm_head = 2.0 * h * cfg.vocab_size  # type: ignore[attr-defined]
    return {"products": products, "attention": attention, "lm_head": lm_head,
            "total": products + attention + lm_head}


def prefill(lengths: list[int], repeats: int, peak: float | None, clock: str,
            engine_args: dict[str, object]) -> list[dict[str, object]]:
    """TTFT per prompt length; with ``clock`` "cpu" the process's CPU time (run it with
    ``--threads 1``: a neighbour's load then barely moves it, and the fraction is of one core's
    peak)."""
    import random

    from tailserve import LLM, SamplingParams

    now = time.process_time if clock == "cpu" else time.perf_counter
    if peak and clock == "cpu":
        cores = len(os.sched_getaffinity(0))
        peak = peak / cores * torch.get_num_threads()

    args: dict[str, object] = {"enable_prefix_caching": False,
                               "max_num_batched_tokens": max(lengths), **engine_args}
    llm = LLM(None, **args)  # type: ignore[arg-type]
    cfg = llm.engine.model_config
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def once(n: int) -> float:
        ids = [rng.randrange(100, cfg.vocab_size) for _ in range(n)]
        t0 = now()
        out = llm.generate({"prompt_token_ids": ids}, params)
        spent = now() - t0
        metrics = out[0].metrics
        assert metrics is not None
        steps.append(metrics.num_steps)
        return spent

    steps: list[int] = []
    for n in lengths:
        once(n)
    rows: list[dict[str, object]] = []
    for n in lengths:
        steps.clear()
        times = sorted(once(n) for _ in range(repeats))
        ops = prefill_ops(cfg, n)
        med = times[len(times) // 2]
        rate = ops["total"] / med
        row: dict[str, object] = {"part": "prefill", "tokens": n, "clock": clock,
                                  "steps": steps[:], "engine_args": engine_args,
                                  "threads": torch.get_num_threads(), "ttft_median_s": med,
                                  "ttft_min_s": times[0], "ops": ops, "ops_s": rate}
        frac = ""
        if peak:
            row["fraction_of_peak"] = rate / peak
            frac = (f"  {rate / peak:5.1%} of the int8 peak (AMX where it serves, else VNNI) "
                    f"of {torch.get_num_threads()} core(s)")
        rows.append(row)
        print(f"{n:5d} tokens in {min(steps)}-{max(steps)} steps: TTFT median "
              f"{med * 1e3:7.1f} ms (min {times[0] * 1e3:.1f})  "
              f"{ops['total'] / 1e9:6.1f} GOP  {rate / 1e9:5.0f} GOP/s{frac}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=["silicon", "torch", "prefill"])
    ap.add_argument("--iters", type=int, default=20_000_000)
    ap.add_argument("--rows", default="128,512,2048")
    ap.add_argument("--lengths", default="128,512,1000,2000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--peak", type=float, default=None, help="int8 peak ops/s (else the "
                    "silicon part's, when it runs: AMX's where the CPU has it, else VNNI's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (torch and "
                    "prefill parts)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="prefill part: wall clock, or the process's CPU time (with --threads 1)")
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=JSON (prefill "
                    "part), e.g. slo_itl_ms=None for steps sized by the token budget alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = args.part or ["silicon", "torch", "prefill"]
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, object]] = []
    peak = args.peak
    if "silicon" in parts:
        found = silicon(args.iters)
        rows += found
        vnni = [r for r in found if str(r["kernel"]).startswith("int8 vpdpbusd")]
        amx = [r for r in found if str(r["kernel"]).startswith("int8 AMX")]
        if peak is None and (amx or vnni):  # the int8 instruction the products run on
            peak = float((amx or vnni)[0]["peak_ops_s"])  # type: ignore[arg-type]
    if "torch" in parts:
        rows += torch_rates([int(m) for m in args.rows.split(",")], args.repeats)
    if "prefill" in parts:
        rows += prefill([int(n) for n in args.lengths.split(",")], args.repeats, peak,
                        args.clock,
                        {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.engine_arg)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
