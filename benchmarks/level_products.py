"""One GGUF product at several instruction-set levels, side by side in one process: the time
of ``torch.ops.tailserve.quant_linear`` (best of ``--repeats`` calls, both cores) and its
rate in TOP/s (2 M N K operations), per format, shape and row count of x
(benchmarks/notes/cpu_kernels.md).

    python benchmarks/level_products.py --formats Q4_K,Q6_K --shapes 16384x3072,3072x8192 \\
        --rows 16,256 --levels avx512vnni,amx,amx-bf16

Weights are random blocks (random bytes, half-precision scales of a realistic size): a product
takes the same time whatever its values. The 32-value formats are timed tiled, as the runner
serves them; the K-quants as stored. Levels the machine cannot run are skipped with the reason.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from tailserve.kernels import QUANT_ISAS, cpu_ops_available, set_quant_isa
from tailserve.model.quant.formats import PACKED_FORMATS, BlockFormat, tile_blocks

Q = gguf.GGMLQuantizationType
# Byte offsets of each format's half-precision scales within a block (the rest stays random).
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_weight(fmt: BlockFormat, n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for off in HALF_OFFSETS[fmt.name]:
        half = (rng.uniform(-1, 1, size=raw.shape[:2]) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    w = torch.from_numpy(raw)
    return tile_blocks(w) if fmt.block_size == 32 else w


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
            w = random_weight(fmt, n, k)
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
