"""What keying the prefix cache costs: the block hashes of a 4,000-token prompt under each
``--prefix-caching-hash-algo`` (sha256, the default, and xxh64), against that prompt's prefill.

The hashes are timed as the block manager computes them (``KVCacheManager._block_hashes`` of a
fresh request: every full block of the prompt, chained), best of ``--repeats``; the prefill is
the in-process ``LLM`` with the bundled model, prefix caching off, ``max_tokens=1`` (prefill and
the first sample), median of ``--repeats`` fresh random prompts. One JSON line out.

    python benchmarks/block_hashing.py
    python benchmarks/block_hashing.py --tokens 4000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tailserve import LLM, SamplingParams
from tailserve.kv.block_pool import HASH_ALGOS
from tailserve.kv.manager import KVCacheManager
from tailserve.request import Request


def hash_seconds(algo: str, ids: list[int], block_size: int, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats):
        kv = KVCacheManager(8, block_size, hash_algo=algo)  # type: ignore[arg-type]
        req = Request(f"r{i}", ids, SamplingParams(max_tokens=1), cache_salt="tenant")
        t0 = time.perf_counter()
        kv._block_hashes(req, len(ids) // block_size)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(None, enable_prefix_caching=False, max_model_len=args.tokens + 16)
    block_size = llm.engine.config.cache.block_size
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.tokens)]
               for _ in range(args.repeats + 1)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill = []
    for ids in prompts:
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params)
        prefill.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill[1:])  # the first warms up
    out: dict[str, object] = {"tokens": args.tokens, "block_size": block_size,
                              "prefill_s": round(prefill_s, 4)}
    for algo in HASH_ALGOS:
        s = hash_seconds(algo, prompts[0], block_size, args.repeats)
        out[f"{algo}_ms"] = round(s * 1e3, 3)
        out[f"{algo}_share_of_prefill"] = round(s / prefill_s, 5)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
