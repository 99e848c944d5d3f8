"""One-row products on GGUF blocks, as a decode step runs them, and the decode step itself.

``products``: the 120 projections of 30 SmolLM2-135M layers (qkv 960 x 576, o 576 x 576,
gate_up 3072 x 576, down 576 x 1536), each its own weight of random blocks in the bundled
file's layout (tiled Q4_1 by default; ``--type-size 144`` stored Q4_K, 34 tiled Q8_0), called
one after the other with one row of x, as ``decode_layers`` calls them: 66 MB per pass, more
than the L3 holds, so every pass reads its weights from memory. Prints the read rate of the
best and the median pass.

``widths``: the same sequence (one row, tiled Q4_1, one weight per projection) for Llama
layers of three widths, the bundled model's (30 x 576) and two wider ones of 1024 and 2048,
each pass followed by a read of ``--read-mib`` by ``roofline.readers``: the read rate of each
sequence over the reader's of the same moment, by width. Products a few hundred KB long pay a
start on each; a model of wider layers streams closer to the reader.

``step``: ``runner.execute`` of one decode-only step of the bundled model (``--seqs``
sequences at ``--context`` tokens, ``engine/calibrate._batch``), min and median of
``--steps`` steps. With ``--windows W``: W windows of ``--steps`` steps, each followed by a
read-bandwidth measure, and each window's median step over the roofline of that moment.

    PYTHONPATH=src python benchmarks/decode_products.py products [--type-size 20] [--rows 1]
    PYTHONPATH=src:benchmarks python benchmarks/decode_products.py widths [--rounds 10]
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/decode_products.py step --context 192
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src:benchmarks python benchmarks/decode_products.py step \
        --context 192 --steps 60 --windows 30

Trees are compared by running each in its own process, alternating (``PYTHONPATH=TREE/src``):
the machine's bandwidth moves with its neighbours by 2x within minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tailserve.data.step import SchedulerOutput
    from tailserve.model.runner import ModelRunner

# (hidden, intermediate, K/V width, layers) of each width ``widths`` compares: the bundled
# model's (also the ``products`` layer), and two wider Llama layers (the 1024 and 2048 of 0.5B-
# and 1B-class models, fewer layers so each pass stays 100-250 MB, beyond the L3).
WIDTHS = ((576, 1536, 192, 30), (1024, 2816, 256, 16), (2048, 5632, 512, 8))


def layer_shapes(hidden: int, intermediate: int, kv: int) -> list[tuple[int, int]]:
    """(N, K) of a layer's projections as the runner fuses them: qkv, o, gate_up, down."""
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * intermediate, hidden),
            (hidden, intermediate)]


LAYER = layer_shapes(*WIDTHS[0][:3])  # the bundled model's: 960 x 576, ..., 576 x 1536


def pass_seconds(products: list[tuple[torch.Tensor, torch.Tensor]], passes: int) -> list[float]:
    """Seconds of each of ``passes`` passes over ``products`` ((weight, x) pairs, in order)."""
    op = torch.ops.tailserve.quant_linear
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for w, x in products:
            op(x, w, None)
        times.append(time.perf_counter() - t0)
    return times


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
    xs = {k: torch.randn(rows, k) for _, k in shapes}
    weights = [(random_blocks(n, k, type_size), xs[k]) for n, k in shapes]
    nbytes = sum(w.numel() for w, _ in weights)
    times = pass_seconds(weights, passes)
    best, median = min(times), statistics.median(times)
    print(f"type_size {type_size}, {rows} row(s), {len(weights)} products, {nbytes / 1e6:.1f} MB: "
          f"best {nbytes / best / 1e9:.1f} GB/s ({best * 1e3:.3f} ms), median "
          f"{nbytes / median / 1e9:.1f} GB/s; {torch.get_num_threads()} threads")


def widths(rounds: int, passes: int, read_mib: int) -> None:
    from roofline import fastest_read, readers

    models = []
    for hidden, inter, kv, layers in WIDTHS:
        shapes = layer_shapes(hidden, inter, kv) * layers
        weights = [(random_blocks(n, k, 20), torch.randn(1, k)) for n, k in shapes]
        models.append((f"{layers} x {hidden}", weights, sum(w.numel() for w, _ in weights)))
    ways = readers(read_mib)
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in models}
    for _ in range(rounds):
        for name, weights, nbytes in models:
            times = pass_seconds(weights, passes)
            reader = read_mib * (1 << 20) / fastest_read(ways, 2)[0] / 1e9
            rates[name].append((nbytes / min(times) / 1e9, reader))
    for name, _, nbytes in models:
        r = rates[name]
        ratios = sorted(g / p for p, g in r)
        print(f"{name}: {nbytes / 1e6:.1f} MB, {len(r)} rounds: products (best of {passes}) "
              f"{statistics.median(p for p, _ in r):.1f} GB/s, reader "
              f"{statistics.median(g for _, g in r):.1f} GB/s; reader / products P25 "
              f"{ratios[len(ratios) // 4]:.2f}, P50 {statistics.median(ratios):.2f}, P75 "
              f"{ratios[3 * len(ratios) // 4]:.2f}; {torch.get_num_threads()} threads")


def step(seqs: int, context: int, steps: int, windows: int, read_mib: int) -> None:
    from mixed_step import build
    from tailserve.engine.calibrate import _batch

    runner, block_size = build("packed")
    sched = _batch(seqs, context, 0, 0, block_size, runner.num_kv_blocks)
    assert sched is not None
    for _ in range(20):
        runner.execute(sched)
    if windows:
        return step_against_the_moment(runner, sched, seqs, context, steps, windows, read_mib)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - t0)
    print(f"{seqs} x {context} decode step: min {min(times) * 1e3:.3f} ms, median "
          f"{statistics.median(times) * 1e3:.3f} ms over {steps}; "
          f"{torch.get_num_threads()} threads")


def step_against_the_moment(runner: ModelRunner, sched: SchedulerOutput, seqs: int, context: int,
                            steps: int, windows: int, read_mib: int) -> None:
    """Each window's median step over the roofline of that moment: the bytes the step reads
    (``tailserve plan``'s count, as serving_peers.py counts them) over the better of two
    ``read_mib`` reads right after the window (roofline.readers: the faster reader). The
    host's bandwidth moves by up to 2x within seconds, so a roofline read minutes away from
    the steps says little about them."""
    from roofline import fastest_read, readers, served_decode_bytes

    weights, kv = served_decode_bytes("float32", context)
    nbytes = weights + kv * seqs
    ways = readers(read_mib)  # built once: random blocks for every window would cost seconds
    rows = []
    for _ in range(windows):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.execute(sched)
            times.append(time.perf_counter() - t0)
        gbps = read_mib * (1 << 20) / fastest_read(ways, 2)[0] / 1e9
        rows.append((statistics.median(times), gbps))
    ratios = sorted(t / (nbytes / (g * 1e9)) for t, g in rows)

    def q(f: float) -> float:
        return ratios[min(len(ratios) - 1, int(f * len(ratios)))]

    print(f"{seqs} x {context} decode step, {windows} windows of {steps}: {nbytes / 1e6:.1f} MB "
          f"a step; read {min(g for _, g in rows):.1f}-{max(g for _, g in rows):.1f} GB/s; "
          f"step median {statistics.median(t for t, _ in rows) * 1e3:.3f} ms; window median "
          f"step / roofline of the moment: P10 {q(0.1):.2f}, P50 {q(0.5):.2f}, P90 {q(0.9):.2f}; "
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
    pw = sub.add_parser("widths")
    pw.add_argument("--rounds", type=int, default=10)
    pw.add_argument("--passes", type=int, default=5)
    pw.add_argument("--read-mib", type=int, default=256)
    ps = sub.add_parser("step")
    ps.add_argument("--seqs", type=int, default=1)
    ps.add_argument("--context", type=int, default=192)
    ps.add_argument("--steps", type=int, default=400, help="steps (per window with --windows)")
    ps.add_argument("--windows", type=int, default=0,
                    help="windows of --steps, each followed by a bandwidth read (0: none)")
    ps.add_argument("--read-mib", type=int, default=256)
    a = p.parse_args()
    from tailserve.kernels import cpu_ops_available

    if not cpu_ops_available():
        raise SystemExit("the CPU kernels are not available here")
    if a.what == "products":
        products(a.type_size, a.rows, a.layers, a.passes)
    elif a.what == "widths":
        widths(a.rounds, a.passes, a.read_mib)
    else:
        step(a.seqs, a.context, a.steps, a.windows, a.read_mib)


if __name__ == "__main__":
    main()
