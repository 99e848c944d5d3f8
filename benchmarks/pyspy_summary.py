"""Summarize a ``py-spy record --format raw`` profile of tailserve: where a step's time goes.

    py-spy record -r 50 --format raw -o prof.txt -- python benchmarks/offline_throughput.py ...
    python benchmarks/pyspy_summary.py prof.txt --within EngineCore.step

Without ``--native`` py-spy charges a torch op's time to the Python line that called it, so
the per-line table reads as "time in this op, including its launch overhead". Categories go by
the first rule (most specific first) that matches any frame of the stack, so an ``nn.Linear``
called from the LM head is "lm_head", not "linear".
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import linecache
import os
import re

# (category, pattern over "function (file:line)" frames). The first rule that matches any frame
# of a stack decides, so the list runs from specific to generic: an nn.Linear under
# compute_logits is the LM head, one under LlamaMLP is a linear, glue is what is left.
RULES: list[tuple[str, str]] = [
    ("lm_head (compute_logits)", r"compute_logits"),
    ("sampler", r"tailserve/model/sampler\.py"),
    ("linear (matmul)", r"Linear\.forward"),
    ("attention: decode (gather, mask, SDPA)", r"TorchAttentionBackend\._decode"),
    ("attention: prefill", r"TorchAttentionBackend\._prefill"),
    ("attention: KV write / glue", r"TorchAttentionBackend\.forward"),
    ("rope", r"RotaryEmbedding|_rotate|apply_rope|ApplyRope"),
    ("rmsnorm", r"RMSNorm"),
    ("mlp glue (silu, mul)", r"LlamaMLP\.forward"),
    ("attention glue (split, view)", r"LlamaAttention\.forward"),
    ("layer glue (residual add)", r"LlamaDecoderLayer\.forward|LlamaForCausalLM\.forward"),
    ("embedding", r"Embedding\.forward"),
    ("runner _prepare (python -> tensors)", r"ModelRunner\._prepare"),
    ("runner execute glue", r"ModelRunner\.execute"),
    ("scheduler", r"tailserve/engine/scheduler\.py|tailserve/kv/"),
    ("output processing / detokenize", r"output_processor\.py|tokeniz"),
    ("engine core glue (stats)", r"tailserve/engine/core\.py"),
    ("LLM loop", r"tailserve/engine/llm\.py"),
]
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def _source_line(file: str, line: int) -> str:
    """The text of ``file:line`` where ``file`` is py-spy's short (package-relative) path."""
    top = file.split("/", 1)[0]
    candidates = [file]
    spec = importlib.util.find_spec(top) if top.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(os.path.join(os.path.dirname(loc), file))
    for path in candidates:
        text = linecache.getline(path, line).strip()
        if text:
            return text
    return ""


def categorize(frames: list[str]) -> str:
    for name, pattern in RULES:
        if any(re.search(pattern, frame) for frame in frames):
            return name
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy --format raw output")
    ap.add_argument("--within", default="EngineCore.step",
                    help="keep only stacks containing a frame with this text ('' = all)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--show-source", action="store_true",
                    help="print each line's text as it is on disk now (wrong if the file changed "
                    "since the profile was taken)")
    args = ap.parse_args()

    total = kept = 0
    by_cat: collections.Counter[str] = collections.Counter()
    by_line: collections.Counter[str] = collections.Counter()
    by_func: collections.Counter[str] = collections.Counter()
    with open(args.raw) as f:
        for row in f:
            stack, _, count = row.rstrip("\n").rpartition(" ")
            n = int(count)
            total += n
            frames = stack.split(";")
            if args.within and not any(args.within in fr for fr in frames):
                continue
            kept += n
            by_cat[categorize(frames)] += n
            # The innermost tailserve frame: the line of *our* code responsible for the time.
            ours = [fr for fr in frames if "tailserve/" in fr] or frames[-1:]
            by_line[ours[-1]] += n
            m = _FRAME.match(ours[-1])
            by_func[f"{m['file']}:{m['func']}" if m else ours[-1]] += n

    print(f"{total} samples, {kept} within {args.within!r} ({100 * kept / max(total, 1):.1f}%)")
    print("\n-- by category (% of kept samples)")
    for name, n in by_cat.most_common():
        print(f"  {100 * n / kept:5.1f}%  {name}")
    print("\n-- innermost tailserve function")
    for name, n in by_func.most_common(args.top):
        print(f"  {100 * n / kept:5.1f}%  {name}")
    print("\n-- innermost tailserve line")
    for frame, n in by_line.most_common(args.top):
        m = _FRAME.match(frame)
        print(f"  {100 * n / kept:5.1f}%  {frame}")
        if args.show_source and m:
            print(f"           {_source_line(m['file'], int(m['line']))}")


if __name__ == "__main__":
    main()
