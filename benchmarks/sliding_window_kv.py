"""Sliding-window KV that saves memory (issue 32 item 3): KV bytes one sequence holds, measured
in the engine, for a sliding-window model against the same model with every layer global, and
the longest context one sequence may have in the same pool.

A tiny random Gemma 3 (transformers' ``Gemma3TextConfig``, Gemma 3's layer pattern: five
sliding layers then a global one, 12 layers) with a window of ``--window`` tokens is served
with a prompt of 4 x the window and 32 generated tokens, chunked by the token budget; the
script records, after every allocation of the block manager, the blocks the sequence holds
over every KV cache group (x the block's bytes), and reports the peak and the bytes at the
end. The same checkpoint with ``layer_types`` all ``full_attention`` is the baseline. Memory
accounting only: the timings of a random tiny model say nothing here.

    python benchmarks/sliding_window_kv.py [--window 128] [--block-size 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tailserve import LLM, SamplingParams
from tailserve.kv_groups import blocks_per_seq, max_blocks_per_seq
from tiny_models import build_tiny_gemma3

LAYERS = 12


def measure(folder: str, prompt_len: int, new_tokens: int, block_size: int,
            budget: int) -> dict[str, Any]:
    llm = LLM(folder, dtype="float32", num_kv_blocks=4096, block_size=block_size,
              max_num_batched_tokens=budget, slo_itl_ms=None, scheduling_policy="fcfs",
              enable_prefix_caching=False)
    config = llm.engine.config
    kv = llm.engine.scheduler.kv
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording(request: Any, *args: Any, **kwargs: Any) -> bool:
        ok = allocate(request, *args, **kwargs)
        held.append(kv.num_blocks_held(request.request_id))
        return ok

    kv.allocate_slots = recording  # type: ignore[method-assign]
    llm.generate([{"prompt_token_ids": list(range(20, 20 + prompt_len))}],
                 SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    block_bytes = config.cache.block_bytes
    return {"groups": config.cache.group_windows, "block_bytes": block_bytes,
            "peak_bytes": max(held) * block_bytes, "end_bytes": held[-1] * block_bytes,
            "end_blocks": held[-1], "peak_blocks": max(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    w, bs = args.window, args.block_size
    prompt = 4 * w - args.new_tokens  # the sequence ends at 4 x the window
    pattern = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
               for i in range(LAYERS)]
    with tempfile.TemporaryDirectory() as tmp:
        common = {"num_hidden_layers": LAYERS, "sliding_window": w,
                  "max_position_embeddings": 8 * w}
        local = build_tiny_gemma3(Path(tmp) / "local", layer_types=pattern, **common)
        dense = build_tiny_gemma3(Path(tmp) / "global",
                                  layer_types=["full_attention"] * LAYERS, **common)
        a = measure(local, prompt, args.new_tokens, bs, args.budget)
        b = measure(dense, prompt, args.new_tokens, bs, args.budget)
    print(f"Gemma 3 pattern, {LAYERS} layers (2 global), window {w}, block {bs}, "
          f"chunks of {args.budget}, a {4 * w}-token sequence ({prompt} prompt + "
          f"{args.new_tokens} generated)")
    for name, m in (("sliding", a), ("every layer global", b)):
        print(f"  {name:20s} groups {m['groups']}, block {m['block_bytes']:,} B: peak "
              f"{m['peak_blocks']} blocks = {m['peak_bytes']:,} B, at the end "
              f"{m['end_blocks']} blocks = {m['end_bytes']:,} B")
    print(f"  at the end: {a['end_bytes'] / b['end_bytes']:.1%} of every layer global; "
          f"peak {a['peak_bytes'] / b['peak_bytes']:.1%}")
    # The longest sequence one pool holds: the pool of a 4 x window all-global sequence.
    pool_bytes = b["end_bytes"]
    for pool_x in (1, 4):
        blocks = pool_x * pool_bytes // a["block_bytes"] - 1  # less the null block
        longest = 0
        step = bs
        while max_blocks_per_seq(a["groups"], longest + step, bs, args.budget) <= blocks:
            longest += step
        dense_longest = pool_x * pool_bytes // b["block_bytes"] * bs
        print(f"  a pool of {pool_x * pool_bytes:,} B: the longest sequence "
              f"{longest:,} tokens sliding (held after its prefill: "
              f"{blocks_per_seq(a['groups'], longest, bs)} blocks) vs "
              f"{dense_longest:,} every layer global")


if __name__ == "__main__":
    main()
