"""Where a one-call step's time goes, op by op: decode_layers' sequence replayed from Python.

Builds the runner of ``mixed_step.py`` (the bundled GGUF, packed weights, its KV pool), makes
the calibration's synthetic batch of each shape (``decodes,ctx,chunk,start``, as there) and
runs, layer by layer on the real weights and pools, the ops ``decode_layers.cpp`` runs, each
timed on its own: the four projections (``quant_linear``), rope, the K/V write, the decode
attention, the norms and SwiGLU; then the LM head and, for comparison, the one call itself.
A shape with a chunk runs its attention as decode_layers does: the decode rows on the decode
kernel, then the chunk on ``paged_prefill_attention`` (the attention column is both). Each
op's sum over the 30 layers, the best of ``--rounds``; a Python call costs a few microseconds
per op, the same at every shape, so the growth with the row count is the kernels'. The
products' column includes quantizing their input rows to int8 (quant_linear does both).
``--clock thread`` times the calling thread's CPU time (with ``--threads 1`` it runs every
work item), which a busy neighbour disturbs far less than the wall clock.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/step_ops.py 1,256,0,0 16,256,0,0
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/step_ops.py 0,0,128,0 0,0,2000,0 \
        --threads 1 --clock thread
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from mixed_step import build
from tailserve.engine.calibrate import _batch

OPS = ("norm", "qkv", "rope", "write_kv", "attention", "o", "gate_up", "silu", "down",
       "lm_head", "one call")


def replay(runner, block_size: int, shape: tuple[int, int, int, int],  # type: ignore[no-untyped-def]
           acc: dict[str, float], clock: Callable[[], float] = time.perf_counter) -> None:
    ops = torch.ops.tailserve
    graph = runner.decode_graph
    sched = _batch(*shape, block_size, runner.num_kv_blocks)
    assert sched is not None and graph is not None
    batch = runner._prepare(sched)
    meta = batch.meta
    tokens = batch.input_ids.numel()
    heads, kv_heads = graph.num_heads, runner.model_config.num_key_value_heads
    head_dim = runner.model_config.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    w = graph.flat_weights
    cos, sin = graph.model.rope.lookup(batch.positions)
    x = graph.model.embed_tokens(batch.input_ids)

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = clock()
        out = fn(*args)
        acc[name] = acc.get(name, 0.0) + clock() - t0
        return out

    nd = meta.num_decodes
    qsl = torch.tensor(meta.query_start_loc, dtype=torch.int64)

    def attention(out: torch.Tensor, q: torch.Tensor, pool: torch.Tensor) -> None:
        if nd:  # as decode_layers: the decode rows, then the chunks after them
            ops.paged_decode_attention(out.narrow(0, 0, nd), q.narrow(0, 0, nd), pool,
                                       meta.block_tables, meta.seq_lens, meta.scale)
        if nd < meta.num_seqs:
            ops.paged_prefill_attention(out, q, pool, meta.block_tables, meta.seq_lens, qsl, nd,
                                        meta.scale)

    residual = x
    h = ops.rms_norm(x, w[0], graph.eps)
    for layer, pool in enumerate(runner.kv_caches):
        lw = w[7 * layer: 7 * layer + 7]
        if layer:
            timed("norm", ops.fused_add_rms_norm, x, residual, lw[0], graph.eps)
            h = x
        qkv = timed("qkv", ops.quant_linear, h, lw[1], None)
        rows = qkv.narrow(1, 0, q_size + kv_size).view(tokens, heads + kv_heads, head_dim)
        timed("rope", ops.rope_, rows, cos, sin)
        k = qkv[:, q_size:q_size + kv_size].reshape(tokens, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:].reshape(tokens, kv_heads, head_dim)
        timed("write_kv", ops.write_kv_cache, pool, k, v, meta.slot_mapping)
        q = qkv.narrow(1, 0, q_size).view(tokens, heads, head_dim)
        attn = torch.empty(tokens, heads, head_dim)
        timed("attention", attention, attn, q, pool)
        h = timed("o", ops.quant_linear, attn.view(tokens, q_size), lw[3], None)
        timed("norm", ops.fused_add_rms_norm, h, residual, lw[4], graph.eps)
        gate_up = timed("gate_up", ops.quant_linear, h, lw[5], None)
        act = timed("silu", ops.silu_and_mul, gate_up)
        x = timed("down", ops.quant_linear, act, lw[6], None)
    ops.fused_add_rms_norm(x, residual, graph.final_norm, graph.eps)
    # The LM head reads the sampled rows only: every decode row and each chunk's last token.
    rows = torch.tensor(sorted({*range(nd), *(e - 1 for e in meta.query_start_loc[nd + 1:])}))
    timed("lm_head", runner.model.compute_logits, x.index_select(0, rows))
    timed("one call", graph, batch.input_ids, batch.positions, runner.kv_caches, meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", default=["1,256,0,0", "16,256,0,0", "32,256,0,0"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    runner, block_size = build("packed")
    best: dict[tuple[int, ...], dict[str, float]] = {}
    with torch.inference_mode():
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for s in shapes:
                acc: dict[str, float] = {}
                replay(runner, block_size, s, acc, clock)  # type: ignore[arg-type]
                if rnd:
                    prev = best.setdefault(s, acc)
                    for k, v in acc.items():
                        prev[k] = min(prev[k], v)
    print(f"best of {args.rounds} rounds, ms (sum over the layers), threads "
          f"{torch.get_num_threads()}, {args.clock} clock")
    print(f"{'(decodes, ctx, chunk, start)':22}" + "".join(f"{k:>10}" for k in OPS))
    for s, d in best.items():
        print(f"{s!s:22}" + "".join(f"{d[k] * 1e3:10.2f}" for k in OPS))


if __name__ == "__main__":
    main()
