"""One GGUF product at several instruction-set levels, side by side in one process: the time
of ``torch.ops.tailserve.quant_linear`` (best of ``--repeats`` calls, both cores) and its
rate in TOP/s (2 M N K operations), per format, shape and row count of x
(benchmarks/notes/cpu_kernels.md).

    python benchmarks/level_products.py --formats Q4_K,Q6_K --shapes 16384x3072,3072x8192 \\
        --rows 16,256 --levels avx512vnni,amx,amx-bf16

Weights are decode_products.py's random blocks (random bytes, small finite half-precision
scales): a product takes the same time whatever its values. The 32-value formats are timed
tiled, as the runner serves them; the K-quants as stored. Levels the machine cannot run are
skipped with the reason.
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from decode_products import random_blocks
from tailserve.kernels import QUANT_ISAS, cpu_ops_available, set_quant_isa
from tailserve.model.quant.formats import PACKED_FORMATS

Q = gguf.GGMLQuantizationType


def best_of(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` products (after one warm-up call: scratch
    buffers, pool threads)."""
    torch.ops.tailserve.quant_linear(x, w, None)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.ops.tailserve.quant_linear(x, w, None)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default="16384x3072,3072x8192", help="NxK, comma-separated")
    ap.add_argument("--rows", default="16,256")
    ap.add_argument("--levels", default="avx512vnni,amx,amx-bf16")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not cpu_ops_available():
        raise SystemExit("the CPU kernels are not built")
    levels = []
    for lv in a.levels.split(","):
        if QUANT_ISAS.get(lv, -1) < 0:
            raise SystemExit(f"unknown level {lv!r}: one of {', '.join(QUANT_ISAS)}")
        try:
            if set_quant_isa(lv) == lv:
                levels.append(lv)
                continue
        except (RuntimeError, ValueError) as e:
            print(f"skipping {lv}: {e}")
            continue
        print(f"skipping {lv}: this machine runs up to {set_quant_isa('auto')}")
    for name in a.formats.split(","):
        fmt = PACKED_FORMATS[getattr(Q, name)]
        for shape in a.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = random_blocks(n, k, fmt.type_size)
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, k)
                cells = []
                for lv in levels:
                    set_quant_isa(lv)
                    s = best_of(x, w, a.repeats)
                    cells.append(f"{lv} {s * 1e3:7.1f} ms {2 * m * n * k / s / 1e12:4.2f} T")
                print(f"{name:5} {n:>6} x {k:<6} {m:>4} rows | " + " | ".join(cells), flush=True)
    set_quant_isa("auto")


if __name__ == "__main__":
    main()
