"""What keying the prefix cache costs: the block hashes of a 4,000-token prompt under each
``--prefix-caching-hash-algo`` (sha256, the default, and xxh64), against that prompt's prefill.

The hashes are timed as the block manager computes them (``KVCacheManager._block_hashes`` of a
fresh salted request: every full block of the prompt, chained), best and median of
``--hash-repeats``, before and after the prefills; the prefill is the in-process ``LLM`` with
the bundled model, prefix caching off, ``max_tokens=1`` (prefill and the first sample), median
of ``--repeats`` fresh random prompts after one to warm up. One JSON line out, with the load
average; exit status 1 when a hash's median costs more than ``--target`` of the prefill (issue
34: 2%).

    python benchmarks/block_hashing.py
    python benchmarks/block_hashing.py --tokens 4000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from tailserve import LLM, SamplingParams
from tailserve.kv.block_pool import HASH_ALGOS
from tailserve.kv.manager import KVCacheManager
from tailserve.request import Request


def hash_seconds(algo: str, ids: list[int], block_size: int, repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        kv = KVCacheManager(8, block_size, hash_algo=algo)  # type: ignore[arg-type]
        req = Request(f"r{i}", ids, SamplingParams(max_tokens=1), cache_salt="tenant")
        t0 = time.perf_counter()
        kv._block_hashes(req, len(ids) // block_size)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3, help="prefills timed (after a warm-up)")
    ap.add_argument("--hash-repeats", type=int, default=50)
    ap.add_argument("--target", type=float, default=0.02)
    args = ap.parse_args()
    load_before = os.getloadavg()
    llm = LLM(None, enable_prefix_caching=False, max_model_len=args.tokens + 16)
    block_size = llm.engine.config.cache.block_size
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.tokens)]
               for _ in range(args.repeats + 1)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    hashes = {algo: hash_seconds(algo, prompts[0], block_size, args.hash_repeats)
              for algo in HASH_ALGOS}
    prefill = []
    for ids in prompts:
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params)
        prefill.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill[1:])  # the first warms up
    out: dict[str, object] = {"tokens": args.tokens, "block_size": block_size,
                              "prefill_s": round(prefill_s, 4),
                              "prefill_each_s": [round(x, 3) for x in prefill]}
    ok = True
    for algo in HASH_ALGOS:
        times = hashes[algo] + hash_seconds(algo, prompts[0], block_size, args.hash_repeats)
        med = statistics.median(times)
        out[f"{algo}_best_ms"] = round(min(times) * 1e3, 3)
        out[f"{algo}_median_ms"] = round(med * 1e3, 3)
        out[f"{algo}_share_of_prefill"] = f"{med / prefill_s:.2e}"
        ok &= med <= args.target * prefill_s
    out["loadavg_before_after"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
