"""Does batching change a greedy answer? The 16 prompts of greedy_vs_llamacpp.py, 64 tokens
each at temperature 0 (EOS ignored), run one at a time and then all 16 in one batch, at the
kernel level in force (``TAILSERVE_QUANT_ISA``): the prompts whose tokens differ, and where.

At the default levels the 32-value formats' products are the same at every row count, while
the K-quants' 1-8-row decode kernels add in another order than their many-row ones (float32
rounding that can move a near-tie); at ``amx-bf16`` the products of 16+ rows round x to bf16
while fewer rows stay on VNNI's int8, so a sequence's numbers depend on how many others share
its steps (benchmarks/notes/cpu_kernels.md).

    PYTHONPATH=src python benchmarks/batch_invariance.py [--model PATH] [--json F]
    TAILSERVE_QUANT_ISA=amx-bf16 PYTHONPATH=src python benchmarks/batch_invariance.py
"""

from __future__ import annotations

import argparse
import json

from greedy_vs_llamacpp import PROMPTS  # run as a script: benchmarks/ is on the path


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    from tailserve import LLM, SamplingParams
    from tailserve.kernels import isa_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    llm = LLM(ns.model)
    sp = SamplingParams(temperature=0, max_tokens=ns.tokens, ignore_eos=True)
    alone = [list(llm.generate([p], sp)[0].outputs[0].token_ids) for p in PROMPTS]
    together = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp)]
    firsts = [first_difference(a, b) for a, b in zip(alone, together, strict=True)]
    changed = {p: f for p, f in zip(PROMPTS, firsts, strict=True) if f is not None}
    level = isa_info().level
    report = {"model": ns.model or "bundled", "level": level, "prompts": len(PROMPTS),
              "tokens": ns.tokens, "changed": len(changed), "first_difference": changed}
    print(f"level {level}: {len(changed)} of {len(PROMPTS)} answers changed by batching"
          + (f"; first differing token at {sorted(changed.values())}" if changed else ""))
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
