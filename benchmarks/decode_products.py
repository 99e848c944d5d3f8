"""One-row products on GGUF blocks, as a decode step runs them, and the decode step itself.

``products``: the 120 projections of 30 SmolLM2-135M layers (qkv 960 x 576, o 576 x 576,
gate_up 3072 x 576, down 576 x 1536), each its own weight of random blocks in the bundled
file's layout (tiled Q4_1 by default; ``--type-size 144`` stored Q4_K, 34 tiled Q8_0), called
one after the other with one row of x, as ``decode_layers`` calls them: 66 MB per pass, more
than the L3 holds, so every pass reads its weights from memory. Prints the read rate of the
best and the median pass.

``step``: ``runner.execute`` of one decode-only step of the bundled model (``--seqs``
sequences at ``--context`` tokens, ``engine/calibrate._batch``), min and median of
``--steps`` steps.

    PYTHONPATH=src python benchmarks/decode_products.py products [--type-size 20] [--rows 1]
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/decode_products.py step --context 192

Trees are compared by running each in its own process, alternating (``PYTHONPATH=TREE/src``):
the machine's bandwidth moves with its neighbours by 2x within minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) of each projection


def random_blocks(n: int, k: int, type_size: int) -> torch.Tensor:
    """Random blocks [n, k / block, type_size] with small, finite fp16 scales, tiled where the
    runner tiles them (the 32-value formats)."""
    from tailserve.model.quant.formats import tile_blocks

    block = 32 if type_size < 100 else 256
    w = torch.randint(0, 256, (n, k // block, type_size), dtype=torch.uint8)
    scale = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # fp16 2^-7
    at = 208 if type_size == 210 else 0  # Q6_K keeps its d last
    w[..., at:at + 2] = scale
    if type_size in (20, 24, 144, 176):  # the formats with a second fp16 (m, dmin)
        w[..., 2:4] = scale
    return tile_blocks(w)


def products(type_size: int, rows: int, layers: int, passes: int) -> None:
    k_quant = type_size > 100
    shapes = [(n, 512 if k_quant and k == 576 else k) for n, k in LAYER] * layers
    weights = [(random_blocks(n, k, type_size), k) for n, k in shapes]
    nbytes = sum(w.numel() for w, _ in weights)
    xs = {k: torch.randn(rows, k) for _, k in weights}
    op = torch.ops.tailserve.quant_linear
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for w, k in weights:
            op(xs[k], w, None)
        times.append(time.perf_counter() - t0)
    best, median = min(times), statistics.median(times)
    print(f"type_size {type_size}, {rows} row(s), {len(weights)} products, {nbytes / 1e6:.1f} MB: "
          f"best {nbytes / best / 1e9:.1f} GB/s ({best * 1e3:.3f} ms), median "
          f"{nbytes / median / 1e9:.1f} GB/s; {torch.get_num_threads()} threads")


def step(seqs: int, context: int, steps: int) -> None:
    from mixed_step import build
    from tailserve.engine.calibrate import _batch

    runner, block_size = build("packed")
    sched = _batch(seqs, context, 0, 0, block_size, runner.num_kv_blocks)
    assert sched is not None
    for _ in range(20):
        runner.execute(sched)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - t0)
    print(f"{seqs} x {context} decode step: min {min(times) * 1e3:.3f} ms, median "
          f"{statistics.median(times) * 1e3:.3f} ms over {steps}; "
          f"{torch.get_num_threads()} threads")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("products")
    pp.add_argument("--type-size", type=int, default=20,
                    choices=(18, 20, 22, 24, 34, 144, 176, 210))
    pp.add_argument("--rows", type=int, default=1)
    pp.add_argument("--layers", type=int, default=30)
    pp.add_argument("--passes", type=int, default=40)
    ps = sub.add_parser("step")
    ps.add_argument("--seqs", type=int, default=1)
    ps.add_argument("--context", type=int, default=192)
    ps.add_argument("--steps", type=int, default=400)
    a = p.parse_args()
    from tailserve.kernels import cpu_ops_available

    if not cpu_ops_available():
        raise SystemExit("the CPU kernels are not available here")
    if a.what == "products":
        products(a.type_size, a.rows, a.layers, a.passes)
    else:
        step(a.seqs, a.context, a.steps)


if __name__ == "__main__":
    main()
