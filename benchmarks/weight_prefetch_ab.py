"""The decode step of a model under two or more weight prefetch settings, interleaved in one
process (``TAILSERVE_WEIGHT_PREFETCH``, csrc/isa.h), each round followed by a read-bandwidth
measure (roofline.readers).

    PYTHONPATH=src:benchmarks python benchmarks/weight_prefetch_ab.py MODEL l1:4096 l2:8192 \
        [--rounds 4] [--json PATH]

MODEL is a GGUF file or ``default`` (the bundled model). One greedy 256-token prompt generates
32 tokens per setting and round; the median of its decode-only steps (``LLM.step_stats``) is
that round's figure. The host's bandwidth moves within minutes, so the settings alternate
round by round instead of running one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from roofline import fastest_read, readers
from tailserve import LLM, SamplingParams
from tailserve.kernels import set_weight_prefetch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file, or `default` for the bundled model")
    ap.add_argument("settings", nargs="+", help="TAILSERVE_WEIGHT_PREFETCH values")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None, metavar="PATH", help="append one JSON line here")
    args = ap.parse_args()
    llm = LLM() if args.model == "default" else LLM(args.model, max_model_len=4096)
    ways = readers(256)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompt: list[Any] = [{"prompt_token_ids": [(7 * j) % 40000 + 100 for j in range(256)]}]
    llm.generate(prompt, params)  # warm-up
    steps: dict[str, list[float]] = {s: [] for s in args.settings}
    reads = []
    for _ in range(args.rounds):
        for setting in args.settings:
            set_weight_prefetch(setting)
            llm.step_stats.clear()
            llm.generate(prompt, params)
            steps[setting].append(statistics.median(
                s.step_s for s in llm.step_stats if s.num_prefill_tokens == 0))
        set_weight_prefetch("auto")
        reads.append(256 * (1 << 20) / fastest_read(ways, 2)[0] / 1e9)
    size = os.path.getsize(args.model) if args.model != "default" else None
    row = {"model": os.path.basename(args.model), "file_bytes": size,
           "reader_gbps": [round(g, 2) for g in reads],
           "decode_step_ms": {s: [round(t * 1e3, 2) for t in v] for s, v in steps.items()}}
    for setting, v in steps.items():
        med = statistics.median(v)
        over = (f", {med / (size / (statistics.median(reads) * 1e9)):.2f}x the file over the "
                "median read" if size else "")
        print(f"{row['model']} {setting}: median decode step {med * 1e3:.2f} ms{over}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
