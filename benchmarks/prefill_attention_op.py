"""``paged_prefill_attention`` alone, on SmolLM2-135M's attention shapes (9 query heads, 3 KV
heads, head_dim 64, blocks of 16): one prefill chunk of ``chunk`` tokens after ``start``
cached ones, one layer per call. Prints the best of the rounds, per call and x30 layers, and
the rate in GFLOPS (2 FLOPs per multiply-add of QK^T and PV over the causal triangle).

    python benchmarks/prefill_attention_op.py                      # both threads, wall clock
    python benchmarks/prefill_attention_op.py --threads 1 --clock thread --isa avx2

``--clock thread`` times the calling thread's CPU time (with ``--threads 1`` it runs every
work item), which a busy neighbour on a shared machine disturbs far less than the wall clock.
"""

from __future__ import annotations

import argparse
import time

import torch

from tailserve.kernels import QUANT_ISAS, cpu_ops_available, cpu_ops_error, set_quant_isa

SHAPES = ((0, 32), (900, 32), (900, 16), (900, 8), (0, 512), (0, 1000))
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def case(start: int, chunk: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    ctx = start + chunk
    blocks = -(-ctx // BLOCK) + 1
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: blocks - 1].view(1, -1)
    # q as the model makes it: a view into the step's qkv rows.
    q = torch.randn(chunk, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g)[:, :HEADS]
    return (torch.empty(q.shape), q, kv, tables, torch.tensor([ctx]), torch.tensor([0, chunk]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=[f"{s},{c}" for s, c in SHAPES],
                    help="start,chunk pairs")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--isa", choices=list(QUANT_ISAS), default="auto")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not cpu_ops_available():
        raise SystemExit(f"the CPU kernels are not available: {cpu_ops_error()}")
    torch.set_num_threads(args.threads)
    isa = set_quant_isa(args.isa)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    op = torch.ops.tailserve.paged_prefill_attention
    print(f"threads {args.threads}, ISA {isa}, {args.dtype} pool, {args.clock} clock, "
          f"best of {args.rounds} rounds")
    for shape in args.shapes:
        start, chunk = (int(x) for x in shape.split(","))
        inputs = case(start, chunk, getattr(torch, args.dtype))
        op(*inputs, 0, HEAD_DIM ** -0.5)
        reps = max(3, 4000 // (start + chunk))
        best = float("inf")
        for _ in range(args.rounds):
            t = clock()
            for _ in range(reps):
                op(*inputs, 0, HEAD_DIM ** -0.5)
            best = min(best, (clock() - t) / reps)
        flops = sum(4 * HEADS * HEAD_DIM * (start + j + 1) for j in range(chunk))
        print(f"start {start:5d} chunk {chunk:5d}: {best * 1e3:7.3f} ms per call, "
              f"x{LAYERS} layers {best * LAYERS * 1e3:7.1f} ms, {flops / best / 1e9:6.1f} GFLOPS")


if __name__ == "__main__":
    main()
