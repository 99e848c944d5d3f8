"""``paged_prefill_attention`` alone, on SmolLM2-135M's attention shapes (9 query heads, 3 KV
heads, head_dim 64, blocks of 16): one prefill chunk of ``chunk`` tokens after ``start``
cached ones, one layer per call. Prints the best of the rounds, per call and x30 layers, and
the rate in GFLOPS (2 FLOPs per multiply-add of QK^T and PV over the causal triangle).

    python benchmarks/prefill_attention_op.py                      # both threads, wall clock
    python benchmarks/prefill_attention_op.py --threads 1 --clock thread --isa avx2

``--clock thread`` times the calling thread's CPU time (with ``--threads 1`` it runs every
work item), which a busy neighbour on a shared machine disturbs far less than the wall clock.
``--sdpa float32|bfloat16`` times torch's ``scaled_dot_product_attention`` on the same
problem instead (q, K, V contiguous in that dtype, K/V gathered beforehand and not timed, the
GQA group expanded by ``enable_gqa``; causal from the chunk's start): the alternative kernel a
prefill could call, measured where it is most favoured. Its OpenMP threads follow
``--threads`` as well (``--clock thread`` is then meaningful only with ``--threads 1``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

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


def sdpa_case(inputs: tuple[torch.Tensor, ...], start: int, chunk: int, dtype: torch.dtype
              ) -> tuple[Callable[..., object], tuple[torch.Tensor, ...]]:
    """SDPA on the kernel's problem: q [1, H, chunk, D], K/V [1, H_kv, ctx, D] gathered from
    the pool in the table's order, a causal mask offset by ``start`` (none from position 0,
    where ``is_causal`` says it)."""
    _, q, kv, tables, _, _ = inputs
    ctx = start + chunk
    k, v = (kv[i][tables[0]].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx].transpose(0, 1)
            .unsqueeze(0).to(dtype).contiguous() for i in range(2))
    qd = q.transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
    mask = None
    if start:
        mask = torch.ones(chunk, ctx, dtype=torch.bool).tril(start)

    def run(*_: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=True)
    return run, ()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=[f"{s},{c}" for s, c in SHAPES],
                    help="start,chunk pairs")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--isa", choices=list(QUANT_ISAS), default="auto")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sdpa", choices=("float32", "bfloat16"), default=None,
                    help="time torch's SDPA in this dtype instead of the kernel")
    args = ap.parse_args()
    if not cpu_ops_available():
        raise SystemExit(f"the CPU kernels are not available: {cpu_ops_error()}")
    torch.set_num_threads(args.threads)
    isa = set_quant_isa(args.isa)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    op = torch.ops.tailserve.paged_prefill_attention
    what = f"torch SDPA in {args.sdpa}" if args.sdpa else f"ISA {isa}, {args.dtype} pool"
    print(f"threads {args.threads}, {what}, {args.clock} clock, best of {args.rounds} rounds")
    for shape in args.shapes:
        start, chunk = (int(x) for x in shape.split(","))
        call: Callable[..., object] = op
        inputs = case(start, chunk, getattr(torch, args.dtype))
        if args.sdpa:
            call, inputs = sdpa_case(inputs, start, chunk, getattr(torch, args.sdpa))
        call(*inputs, 0, HEAD_DIM ** -0.5)
        reps = max(3, 4000 // (start + chunk))
        best = float("inf")
        for _ in range(args.rounds):
            t = clock()
            for _ in range(reps):
                call(*inputs, 0, HEAD_DIM ** -0.5)
            best = min(best, (clock() - t) / reps)
        flops = sum(4 * HEADS * HEAD_DIM * (start + j + 1) for j in range(chunk))
        print(f"start {start:5d} chunk {chunk:5d}: {best * 1e3:7.3f} ms per call, "
              f"x{LAYERS} layers {best * LAYERS * 1e3:7.1f} ms, {flops / best / 1e9:6.1f} GFLOPS")


if __name__ == "__main__":
    main()
