"""Greedy continuations of tailserve and llama.cpp's llama-server on the same GGUF, compared.

Both get the same token ids (tailserve's tokenizer; llama-server takes an id list as the prompt
and adds no BOS to it), decode 64 tokens at temperature 0 with EOS ignored and llama-server's
repeat penalty off, and are compared token by token. Per prompt: the identical leading tokens;
overall: the share of all tokens before each prompt's first divergence. The two engines round
differently (tailserve's packed kernels quantize activations to int8 per 32 values as
llama.cpp's do, but sums run in another order), so a step where the top two logits nearly tie
may go either way, and after a divergence the continuations are unrelated: at the first
divergence the top-2 logit margin (logprob 1 - logprob 2, the same difference in logits) is
shown from both sides (the first engine named / the second).

    PYTHONPATH=src python benchmarks/greedy_vs_llamacpp.py [--threads 1] [--gguf PATH]
        [--json out.json]

Starts llama-server through benchmarks/peers/start_llamacpp.sh (installed by
install_llamacpp.sh; shared/PEERS.md) on the GGUF tailserve loads by default, or uses one
already running (--llama-url). tailserve runs in-process (``LLM``, packed GGUF weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import free_port, wait_for_health
from serving_peers import best_llama_flags, cpu_flags

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a robot",
    "The three primary colors are",
    "In 1969, Neil Armstrong",
    "To make a cup of tea, first",
    "import numpy as np\n\ndef normalize(x):",
    "The mitochondria is the powerhouse of",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
    "Photosynthesis converts sunlight into",
    "SELECT name, age FROM users WHERE",
    "My favourite season is autumn because",
    "The largest planet in the solar system is",
    "Water boils at 100 degrees Celsius when",
    "Dear hiring manager, I am writing to",
]


def tailserve_runs(prompts: list[list[int]], tokens: int, gguf_weights: str, model: str
                   ) -> list[dict[str, Any]]:
    from tailserve import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory=0.25, max_model_len=512, gguf_weights=gguf_weights)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    runs = []
    for o in outs:
        c = o.outputs[0]
        runs.append({"tokens": list(c.token_ids), "top2": [_top2(d) for d in c.logprobs or []],
                     "weights": dict(llm.engine.runner.weight_bytes)})
    return runs


def _fmt(m: float | None) -> str:
    return "n/a" if m is None else f"{m:.3f}"


def _top2(logprobs: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:2]


def llama_runs(url: str, prompts: list[list[int]], tokens: int) -> list[dict[str, Any]]:
    runs = []
    with httpx.Client(timeout=600) as client:
        for p in prompts:
            body = {"prompt": p, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                    "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True,
                    "n_probs": 2}
            r = client.post(url + "/completion", json=body)
            r.raise_for_status()
            data = r.json()
            top2 = [[(t["id"], t["logprob"]) for t in step["top_logprobs"][:2]]
                    for step in data.get("completion_probabilities", [])]
            runs.append({"tokens": list(data["tokens"]), "top2": top2})
    return runs


def margin(top2: list[list[tuple[int, float]]], i: int) -> float | None:
    if i >= len(top2) or len(top2[i]) < 2:
        return None
    return float(top2[i][0][1] - top2[i][1][1])


def compare(prompts: list[str], ts: list[dict[str, Any]], lc: list[dict[str, Any]],
            tokens: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for text, a, b in zip(prompts, ts, lc, strict=True):
        same = 0
        for x, y in zip(a["tokens"], b["tokens"], strict=False):
            if x != y:
                break
            same += 1
        diverged = same < min(len(a["tokens"]), len(b["tokens"]))
        rows.append({"prompt": text, "identical_leading": same, "of": tokens,
                     "margin_first": margin(a["top2"], same) if diverged else None,
                     "margin_second": margin(b["top2"], same) if diverged else None})
    total = sum(r["identical_leading"] for r in rows)
    return {"rows": rows, "identical_tokens": total, "total_tokens": tokens * len(rows),
            "agreement": total / (tokens * len(rows)),
            "prompts_identical": sum(r["identical_leading"] == tokens for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="llama-server threads (LLAMA_THREADS; default: all cores)")
    ap.add_argument("--llama-url", default=None, help="a llama-server already running")
    ap.add_argument("--gguf-weights", default="packed",
                    help="tailserve's --gguf-weights, comma-separated to run several: packed "
                    "(the default, the blocks as stored) and/or dequantize (float32 reference)")
    ap.add_argument("--gguf", default=None,
                    help="another GGUF (default: the bundled SmolLM2); e.g. the Gemma 3 270M of "
                    "tests/gemma3_gguf.py")
    ap.add_argument("--json", default=None, help="write the comparison here")
    args = ap.parse_args()

    from tailserve.model.gguf import read_gguf
    from tailserve.model.loader import default_model_path
    from tailserve.model.tokenizer import load_gguf_tokenizer

    gguf = args.gguf or default_model_path()
    tok = load_gguf_tokenizer(gguf)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    # Both engines get ids, and neither adds BOS to ids: a model trained with BOS first
    # (Gemma; the file's tokenizer.ggml.add_bos_token) gets it here, for both alike.
    md = read_gguf(gguf).metadata
    if md.get("tokenizer.ggml.add_bos_token") and md.get("tokenizer.ggml.bos_token_id") \
            is not None:
        ids = [[int(md["tokenizer.ggml.bos_token_id"]), *p] for p in ids]
    proc = None
    url = args.llama_url
    if url is None:
        port = free_port()
        env = {**os.environ, "MODEL_GGUF": gguf, "TAILSERVE_PYTHON": sys.executable}
        if args.threads is not None:
            env["LLAMA_THREADS"] = str(args.threads)
        # serving_peers.py's flags for this CPU (--no-repack on AMX: b11434's repack
        # segfaults there at start).
        flags, _why = best_llama_flags(cpu_flags())
        proc = subprocess.Popen(["bash", os.path.join(HERE, "peers", "start_llamacpp.sh"),
                                 str(port), *flags], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        if not wait_for_health(url, proc, 300):
            proc.kill()
            print("llama-server did not come up (see benchmarks/peers/start_llamacpp.sh)",
                  file=sys.stderr)
            return 1
    try:
        lc = llama_runs(url, ids, args.tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    results = {}
    runs = {}
    for choice in args.gguf_weights.split(","):
        ts = runs[choice] = tailserve_runs(ids, args.tokens, choice, gguf)
        result = results[f"{choice} vs llama.cpp"] = compare(PROMPTS, ts, lc, args.tokens)
        result["tailserve_weights"] = ts[0]["weights"]
    if len(runs) == 2:  # tailserve against itself: what the packed kernels' rounding does
        a, b = runs.values()
        results[" vs ".join(runs)] = compare(PROMPTS, a, b, args.tokens)
    for name, result in results.items():
        print(f"--- tailserve {name} (model {gguf})")
        for r in result["rows"]:
            m = ("" if r["margin_first"] is None else
                 f"  first divergence: top-2 margin {_fmt(r['margin_first'])} / "
                 f"{_fmt(r['margin_second'])}")
            print(f"{r['identical_leading']:3d}/{r['of']}  {r['prompt']!r}{m}")
        margins = [r["margin_first"] for r in result["rows"]
                   if r["margin_first"] is not None]
        print(f"agreement: {result['identical_tokens']}/{result['total_tokens']} tokens before "
              f"the first divergence ({result['agreement']:.1%}); {result['prompts_identical']}/"
              f"{len(PROMPTS)} prompts identical throughout; largest top-2 margin at a "
              f"divergence {max(margins, default=0.0):.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"model": gguf, "comparisons": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
