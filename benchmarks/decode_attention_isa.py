"""paged_decode_attention per instruction set level: K/V from DRAM (cold) or from L3 (hot).

SmolLM2's attention shape (9 query heads, 3 KV heads of 64), ``S`` sequences of ``ctx``
tokens each, over 30 layers' pools in turn (``cold``: 30 x S x ctx x 1536 bytes in float32,
far above L3) or over one layer's pool 30 times (``hot``: the same work, K/V in L3 once read).
Levels interleaved round by round (``avx2``, ``avx512``, as TAILSERVE_QUANT_ISA sets them);
with one thread the clock is the process's CPU time, less disturbed on a shared machine
than the wall clock (a memory stall still counts: the thread is running).

    PYTHONPATH=src python benchmarks/decode_attention_isa.py --seqs 16 --ctx 256 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from tailserve.kernels import cpu_ops_available, set_quant_isa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--levels", nargs="*", default=["avx2", "avx512"])
    args = ap.parse_args()
    if not cpu_ops_available():
        raise SystemExit("the compiled CPU kernels are not available")
    torch.set_num_threads(args.threads)
    ops = torch.ops.tailserve
    layers, bs, kv_heads, head_dim, heads = 30, 16, 3, 64, 9
    per_seq = -(-args.ctx // bs)
    dtype = getattr(torch, args.dtype)
    pools = [torch.randn(2, args.seqs * per_seq, bs, kv_heads, head_dim).to(dtype)
             for _ in range(layers)]
    tables = torch.arange(args.seqs * per_seq).view(args.seqs, per_seq)
    lens = torch.full((args.seqs,), args.ctx, dtype=torch.long)
    q = torch.randn(args.seqs, heads, head_dim)
    out = torch.empty(args.seqs, heads, head_dim)
    kv_bytes = layers * args.seqs * args.ctx * kv_heads * head_dim * 2 * pools[0].element_size()
    clock = time.process_time if args.threads == 1 else time.perf_counter

    def run(cold: bool) -> float:
        t0 = clock()
        for layer in range(layers):
            ops.paged_decode_attention(out, q, pools[layer if cold else 0], tables, lens, 0.125)
        return clock() - t0

    times: dict[str, list[float]] = {}
    for rnd in range(args.rounds + 1):
        for level in args.levels:
            set_quant_isa(level)
            for name in ("cold", "hot"):
                t = run(name == "cold")
                if rnd:
                    times.setdefault(f"{level} {name}", []).append(t)
    set_quant_isa("auto")
    print(f"{args.seqs} seqs x {args.ctx} ctx, {args.dtype} pool, {args.threads} thread(s), "
          f"{kv_bytes / 1e6:.0f} MB of K/V per pass, best and median of {args.rounds}")
    for k, v in times.items():
        v.sort()
        print(f"  {k:12} {v[0] * 1e3:7.2f} ms  (median {v[len(v) // 2] * 1e3:7.2f})  "
              f"{kv_bytes / v[0] / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
