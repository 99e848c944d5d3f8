"""The 16-bit kernels alone, interleaved in one process (best of N): what storage16.py's engine
rows cannot show on a shared machine, whose load drifts between processes.

    decode   SmolLM2-135M's 30 x (qkv, o, gate_up, down) products at one row: float32 panels,
             bf16 panels through vdpbf16ps (where the CPU has it) and widened in registers
    prefill  256 x 576 x 1536 on one thread: oneDNN float32 (prepacked), the float32 panel
             kernel, bf16 vdpbf16ps, bf16 and fp16 widened
    attn     paged decode attention, 16 sequences x 1,000 tokens, 9 / 3 heads of 64, 30 layers:
             float32 pool against a bf16 one

    python benchmarks/storage16_kernels.py [--repeats 8]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from tailserve.kernels import cpu_ops_available
from tailserve.model.transforms.kernel_linear import panel_weight
from tailserve.model.transforms.linear16 import panel16_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
LAYERS = 30


def best_of(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():  # interleaved: every case sees the same drift
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    if not cpu_ops_available():
        raise SystemExit("the CPU kernels are not built")
    from test_cpu_kernels import make_pool

    ops = torch.ops.tailserve
    torch.manual_seed(0)
    ws = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    p32 = [[panel_weight(w) for w in layer] for layer in ws]
    p16 = [[panel16_weight(w.bfloat16()) for w in layer] for layer in ws]
    xs = {k: torch.randn(1, k) for _, k in SHAPES}

    def decode(kind: str, dot: bool = True) -> None:
        ops.set_bf16_dot(dot)
        for layer in range(LAYERS):
            for i, (_, k) in enumerate(SHAPES):
                if kind == "f32":
                    ops.panel_linear(xs[k], p32[layer][i], None)
                else:
                    ops.panel16_linear(xs[k], p16[layer][i], None)

    print("decode, one row, 30 layers (ms):", {k: round(v * 1e3, 1) for k, v in best_of({
        "float32 panels": lambda: decode("f32"),
        "bf16 vdpbf16ps": lambda: decode("bf16", True),
        "bf16 widened": lambda: decode("bf16", False),
    }, args.repeats).items()})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    n, k, m = 1536, 576, 256
    w = torch.randn(n, k).bfloat16()
    pb, ph = panel16_weight(w), panel16_weight(w.half())
    packed = torch.ops.mkldnn._reorder_linear_weight(w.float(), 64)
    pf = panel_weight(w.float())
    x = torch.randn(m, k)

    def with_dot(dot: bool, fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: (ops.set_bf16_dot(dot), fn())

    prefill = best_of({
        "onednn float32": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                     [], ""),
        "float32 panels": lambda: ops.panel_linear(x, pf, None),
        "bf16 vdpbf16ps": with_dot(True, lambda: ops.panel16_linear(x, pb, None)),
        "bf16 widened": with_dot(False, lambda: ops.panel16_linear(x, pb, None)),
        "fp16 widened": lambda: ops.panel16_linear(x, ph, None),
    }, args.repeats)
    print(f"prefill {m}x{k}x{n}, one thread (GFLOPS):",
          {k_: round(2 * m * n * k / v / 1e9) for k_, v in prefill.items()})
    torch.set_num_threads(threads)
    ops.set_bf16_dot(True)

    lens = [1000] * 16
    _, kv, tables = make_pool(lens, 9, 3, 64, torch.float32, seed=1)
    q = torch.randn(16, 9, 64)
    out = torch.empty(q.shape)
    seq_lens = torch.tensor(lens)
    pools = {"float32 pool": [kv.clone() for _ in range(4)],
             "bf16 pool": [kv.bfloat16() for _ in range(4)]}

    def attend(name: str) -> None:
        for layer in range(LAYERS):
            ops.paged_decode_attention(out, q, pools[name][layer % 4], tables, seq_lens, 0.125)

    print("attention, 16 x 1,000 tokens, 30 layers (ms):", {
        k_: round(v * 1e3, 1) for k_, v in best_of(
            {name: functools.partial(attend, name) for name in pools}, args.repeats).items()})


if __name__ == "__main__":
    main()
