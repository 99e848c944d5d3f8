"""Kernel microbenchmarks of the packed decode rows and the prefill attention
(benchmarks/notes/cpu_kernels.md, "Prefill on one pool, robust workers, prefetched decode rows").

    python benchmarks/cpu_kernels_bench.py                 # one thread, process CPU time
    python benchmarks/cpu_kernels_bench.py --threads 2     # two threads, wall time

``stream``: ``quant_linear`` at one row on SmolLM2's shapes, the weights cycled through
``--stream-mb`` of copies so each call reads DRAM as a decode step does (97 MB of weights do
not fit in L3); GB/s of weight bytes, stored blocks then tiled. ``tiles``: ``quant_linear``
per call at 1..512 rows on the stored blocks against the tiled form the runner serves
(``tile_blocks``), interleaved, on the bundled file's blocks (median of ``--repeats``).
``attention``:
``paged_prefill_attention`` against SDPA on one causal prompt (9 / 3 heads of 64), GFLOP/s.
With one thread the time is the process's CPU time, which a shared machine disturbs far less
than wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tailserve.kernels import cpu_ops_available
from tailserve.model.gguf import read_gguf
from tailserve.model.loader import default_model_path
from tailserve.model.quant.formats import tile_blocks

ops = torch.ops.tailserve

# name -> (rows N, features K, bytes per 32-value block): Q4_1 20, Q8_0 34
SHAPES = {
    "qkv Q4_1": (960, 576, 20),
    "gate_up Q4_1": (3072, 576, 20),
    "down Q4_1": (576, 1536, 20),
    "lm_head Q8_0": (49152, 576, 34),
}


def packed(n: int, k: int, type_size: int, g: torch.Generator) -> torch.Tensor:
    w = torch.randint(0, 256, (n, k // 32, type_size), dtype=torch.uint8, generator=g)
    w[:, :, 1] &= 0x3B  # the f16 scale (and Q4_1's min below): finite, moderate exponents
    w[:, :, 3] &= 0x3B
    return w


def bench_stream(clock: Callable[[], float], stream_mb: float, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    for name, (n, k, ts) in SHAPES.items():
        nbytes = n * (k // 32) * ts
        copies = max(1, int(stream_mb * 1e6 // nbytes))
        stored = [packed(n, k, ts, g) for _ in range(copies)]
        x = torch.randn(1, k, generator=g)
        for form, ws in (("stored", stored), ("tiled", [tile_blocks(w) for w in stored])):
            for w in ws:
                ops.quant_linear(x, w, None)
            t0 = clock()
            for _ in range(repeats):
                for w in ws:
                    ops.quant_linear(x, w, None)
            dt = (clock() - t0) / (repeats * copies)
            print(f"stream {name:14s} {form:6s} {dt * 1e3:7.3f} ms  {nbytes / dt / 1e9:5.1f} GB/s"
                  f"  ({nbytes / 1e6:.2f} MB x {copies} copies)")


# name -> tensor of the bundled GGUF (the second layer's gate, up, down; the tied LM head)
TILE_TENSORS = {
    "gate Q4_1 1536x576": "blk.1.ffn_gate.weight",
    "down Q4_1 576x1536": "blk.1.ffn_down.weight",
    "lm_head Q8_0 49152x576": "token_embd.weight",
}


def bench_tiles(clock: Callable[[], float], rows: list[int], repeats: int) -> None:
    f = read_gguf(default_model_path())
    g = torch.Generator().manual_seed(0)
    for name, tensor in TILE_TENSORS.items():
        stored = f.packed(tensor)
        tiled = tile_blocks(stored)
        k = stored.shape[1] * 32
        for m in rows:
            if "lm_head" in name and m > 128:
                continue  # 0.5 s a call: the head runs on the sampled rows only
            x = torch.randn(m, k, generator=g)
            times: dict[str, list[float]] = {"stored": [], "tiled": []}
            for _ in range(repeats):  # interleaved
                for label, w in (("stored", stored), ("tiled", tiled)):
                    t0 = clock()
                    ops.quant_linear(x, w, None)
                    times[label].append(clock() - t0)
            old, new = (statistics.median(times[t]) * 1e3 for t in ("stored", "tiled"))
            print(f"tiles {name:24s} M={m:4d}: stored {old:8.3f} ms  tiled {new:8.3f} ms  "
                  f"x{old / new:.2f}")


def attention_case(n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """The kernel and SDPA on one causal prompt of n tokens (9 / 3 heads of 64)."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    nb = -(-n // bs) + 1
    kv = torch.randn(2, nb, bs, kv_heads, d)
    tables = torch.arange(nb).view(1, -1).long()
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    lens, qsl = torch.tensor([n]), torch.tensor([0, n])
    out = torch.empty(n, heads, d)

    def kernel() -> None:
        ops.paged_prefill_attention(out, q, kv, tables, lens, qsl, 0, 0.125)

    def sdpa() -> None:
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=0.125, enable_gqa=True)

    return kernel, sdpa


def bench_attention(clock: Callable[[], float], lengths: list[int], repeats: int) -> None:
    for n in lengths:
        kernel, sdpa = attention_case(n)
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for _ in range(repeats):  # interleaved
            for label, fn in (("kernel", kernel), ("sdpa", sdpa)):
                t0 = clock()
                fn()
                times[label].append(clock() - t0)
        flops = 4 * 9 * 64 * n * n / 2
        cells = [f"{label} {min(t) * 1e3:.2f} ms (median {statistics.median(t) * 1e3:.2f}, "
                 f"{flops / min(t) / 1e9:.0f} GFLOP/s)" for label, t in times.items()]
        print(f"attention {n:5d} tokens: " + "; ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stream-mb", type=float, default=128.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 128, 512])
    ap.add_argument("--only", choices=["stream", "tiles", "attention"], default=None)
    args = ap.parse_args()
    if not cpu_ops_available():
        raise SystemExit("the CPU kernels are not available here")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    if args.only in (None, "stream"):
        bench_stream(clock, args.stream_mb, 3)
    if args.only in (None, "tiles"):
        bench_tiles(clock, args.rows, args.repeats)
    if args.only in (None, "attention"):
        bench_attention(clock, args.lengths, args.repeats)


if __name__ == "__main__":
    main()
