"""GGUF packed vs dequantized (``--gguf-weights``): decode TPOT, prompt speed, resident memory.

Each mode runs in a fresh process (so resident memory is that mode's alone), the modes
alternate for ``--rounds`` rounds, and the best figure of each is kept: on a shared machine the
best run is the least disturbed one. Also prints the bytes-read roofline of a decode token
(weights as stored + KV, over the measured read bandwidth; ``roofline.py``).

    python benchmarks/gguf_packed.py                 # bundled SmolLM2-135M Q4_1/Q8_0 GGUF
    python benchmarks/gguf_packed.py --rounds 1 --decode-tokens 32   # smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

MODES = ("packed", "dequantize")


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from roofline import decode_bytes, measure_bandwidth
    from tailserve import LLM, SamplingParams

    # No prefix caching: the same prompts are timed again and must be computed again.
    # keep_checkpoint: decode_bytes reads the loaded tensors (RSS as in earlier runs).
    llm = LLM(args.model, dtype="float32", kv_cache_memory=args.kv_gib, gguf_weights=mode,
              max_model_len=2048, enable_prefix_caching=False, keep_checkpoint=True)
    loaded_rss = rss_mb()
    prompt = list(range(1000, 1000 + args.prompt_len))
    long = list(range(2000, 2000 + args.long_prompt_len))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], many)  # warm-up
    best = {"tpot_ms": float("inf"), "ttft_ms": float("inf"), "long_prompt_tok_s": 0.0}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one)
        t1 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], many)
        t2 = time.perf_counter()
        llm.generate([{"prompt_token_ids": long}], one)
        t3 = time.perf_counter()
        tpot = ((t2 - t1) - (t1 - t0)) / (args.decode_tokens - 1) * 1e3
        best["tpot_ms"] = min(best["tpot_ms"], tpot)
        best["ttft_ms"] = min(best["ttft_ms"], (t1 - t0) * 1e3)
        best["long_prompt_tok_s"] = max(best["long_prompt_tok_s"], len(long) / (t3 - t2))
    cfg = llm.engine.loaded.config
    db = decode_bytes(llm.engine.loaded.weights, cfg.num_hidden_layers,
                      cfg.num_key_value_heads, cfg.head_dim, 4)
    bw = measure_bandwidth(copy_mib=256, read_mib=512, repeats=3)
    ctx = args.prompt_len + args.decode_tokens / 2
    read = db.weight_bytes + db.kv_bytes(ctx)
    return {
        "mode": mode, **best, "rss_after_load_mb": loaded_rss, "rss_after_mb": rss_mb(),
        "kv_pool_mb": llm.engine.runner.kv_cache_bytes / 2**20,
        "weight_bytes": dict(llm.engine.runner.weight_bytes),
        "bytes_read_per_token_mb": read / 1e6, "read_gbps": bw.read_gbps,
        "roofline_ms": read / (bw.read_gbps * 1e9) * 1e3, "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timings per process")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--long-prompt-len", type=int, default=1000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=0.25)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args)))
        return
    child = [a for a in sys.argv[1:]]
    results: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, *child, "--mode", mode],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            prev = results.get(mode)
            if prev is None:
                results[mode] = r
            else:
                prev["tpot_ms"] = min(prev["tpot_ms"], r["tpot_ms"])
                prev["ttft_ms"] = min(prev["ttft_ms"], r["ttft_ms"])
                prev["long_prompt_tok_s"] = max(prev["long_prompt_tok_s"], r["long_prompt_tok_s"])
                prev["roofline_ms"] = min(prev["roofline_ms"], r["roofline_ms"])
    for mode, r in results.items():
        weights = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(r["weight_bytes"].items()))
        print(f"{mode:>10}: TPOT {r['tpot_ms']:.2f} ms (roofline {r['roofline_ms']:.2f} ms: "
              f"{r['bytes_read_per_token_mb']:.1f} MB/token at {r['read_gbps']:.1f} GB/s), "
              f"first token ({args.prompt_len}) {r['ttft_ms']:.0f} ms, "
              f"{args.long_prompt_len}-token prompt {r['long_prompt_tok_s']:.0f} tok/s, "
              f"RSS {r['rss_after_mb']:.0f} MB (KV pool {r['kv_pool_mb']:.0f} MB; weights "
              f"{weights})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
