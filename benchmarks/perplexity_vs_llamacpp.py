"""Perplexity of tailserve and llama.cpp's ``llama-perplexity`` on the same GGUF and text.

llama-perplexity cuts the tokenized text (BOS first) into chunks of ``--ctx`` tokens, puts BOS
at the start of each, runs each chunk alone and scores the second half of it: the negative
log-likelihood of tokens ``ctx/2 + 1 .. ctx - 1`` given what precedes them in the chunk; the
perplexity is exp of their mean. tailserve is scored the same way, on the same token ids
(llama.cpp's ``llama-tokenize`` of the text; tailserve's own tokenization is compared with
them and reported), each chunk one prefill through the served model (packed GGUF weights by
default, as ``tailserve serve`` loads them), logits in float64 for the softmax.

    PYTHONPATH=src python benchmarks/perplexity_vs_llamacpp.py \\
        [--gguf PATH] [--text FILE] [--ctx 64] [--threads 2] [--transformers] [--json F]

Default GGUF: the Gemma 3 270M of tests/gemma3_gguf.py (``python tests/gemma3_gguf.py``
fetches it); default text: Debian's /usr/share/common-licenses/GPL-3 where present (7,563
tokens), else tests/data/perplexity.txt (297). Needs llama.cpp built by
benchmarks/peers/install_llamacpp.sh; the two tools are built here if missing
(``cmake --build build --target llama-perplexity llama-tokenize``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

from serving_peers import best_llama_flags, cpu_flags  # noqa: E402

PEERS = os.environ.get("TAILSERVE_PEERS_HOME", os.path.expanduser("~/.cache/tailserve-peers"))
LLAMA = os.path.join(PEERS, "llama.cpp")
SHORT_TEXT = os.path.join(ROOT, "tests", "data", "perplexity.txt")
LONG_TEXT = "/usr/share/common-licenses/GPL-3"  # Debian's base-files ship it
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def tool(name: str) -> str:
    path = os.path.join(LLAMA, "build", "bin", name)
    if not os.path.exists(path):
        subprocess.run(["cmake", "--build", os.path.join(LLAMA, "build"), "--target", name,
                        "-j", str(os.cpu_count() or 1)], check=True)
    return path


def llama_ids(gguf: str, text: str) -> list[int]:
    out = subprocess.run([tool("llama-tokenize"), "-m", gguf, "-f", text, "--ids",
                          "--log-disable"], check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.strip().strip("[]").split(",") if x.strip()]


def llama_perplexity(gguf: str, text: str, ctx: int, threads: int) -> dict[str, Any]:
    # The flags serving_peers.py starts llama-server with on this CPU: on AMX CPUs b11434's
    # weight repack segfaults (exit -11) in llama-perplexity as in llama-server.
    flags, why = best_llama_flags(cpu_flags())
    res = subprocess.run([tool("llama-perplexity"), "-m", gguf, "-f", text, "-c", str(ctx),
                          "-b", str(ctx), "-t", str(threads), *flags],
                         capture_output=True, text=True)
    m = _FINAL.search(res.stdout + res.stderr)
    if res.returncode != 0 or m is None:
        tail = (res.stdout + res.stderr)[-2000:]
        raise RuntimeError(f"llama-perplexity failed (exit {res.returncode}):\n{tail}")
    return {"ppl": float(m.group(1)), "ppl_error": float(m.group(2)), "flags": flags,
            "flags_why": why}


def chunk_nll(logits: torch.Tensor, chunk: list[int]) -> list[float]:
    """llama-perplexity's scored positions of one chunk: -log p(chunk[j + 1]) for j from
    ctx/2 to ctx - 2."""
    ctx = len(chunk)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return [-float(logp[j, chunk[j + 1]]) for j in range(ctx // 2, ctx - 1)]


def tailserve_perplexity(gguf: str, ids: list[int], ctx: int, gguf_weights: str
                         ) -> dict[str, Any]:
    from tailserve.model.loader import load_model
    from test_gguf_packed import make_runner, runner_logits

    loaded = load_model(gguf, gguf_weights=gguf_weights)
    # The pool holds one chunk whatever the layer groups (a sliding-window model's local
    # and global layers each take their own blocks): generously, 8 tables of ctx tokens.
    runner = make_runner(loaded.config, loaded.weights, max_model_len=max(512, ctx),
                         num_kv_blocks=max(64, 8 * -(-ctx // 16)))
    bos = ids[0]
    nll: list[float] = []
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        chunk[0] = bos  # as llama-perplexity does
        nll += chunk_nll(runner_logits(runner, chunk), chunk)
    return {"ppl": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll),
            "chunks": len(ids) // ctx, "tokenizer": loaded.tokenizer}


def transformers_perplexity(gguf: str, ids: list[int], ctx: int) -> dict[str, Any]:
    """The reference: transformers on the same file, dequantized to float32."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                              dtype=torch.float32).eval()
    nll: list[float] = []
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        chunk[0] = ids[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([chunk])).logits[0]
        nll += chunk_nll(logits, chunk)
    return {"ppl": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll)}


def default_text() -> str:
    """A long fixed text where the system has one: on the 297 tokens of perplexity.txt (124-126
    scored) the two engines' ratio moved by 2.2% between machines (llama.cpp's own result
    did: Zen 4 vs Intel), on the 7,563 of GPL-3 it stays within 0.11% at every ctx
    (benchmarks/notes/weights.md)."""
    return LONG_TEXT if os.path.exists(LONG_TEXT) else SHORT_TEXT


def main() -> None:
    from gemma3_gguf import MISSING, gemma3_270m_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--text", default=default_text(),
                    help="the text scored (default: Debian's GPL-3 text, 7,563 tokens, where "
                         "the system has it, else the 297-token tests/data/perplexity.txt)")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gguf-weights", default="packed", choices=["packed", "dequantize"])
    ap.add_argument("--transformers", action="store_true",
                    help="also transformers on the same file (float32), the reference")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    gguf = ns.gguf or gemma3_270m_gguf()
    if gguf is None:
        sys.exit(MISSING)
    ids = llama_ids(gguf, ns.text)
    ours = tailserve_perplexity(gguf, ids, ns.ctx, ns.gguf_weights)
    tok = ours.pop("tokenizer")
    with open(ns.text, encoding="utf-8") as f:
        own = [ids[0], *tok.encode(f.read(), add_special_tokens=False)]
    theirs = llama_perplexity(gguf, ns.text, ns.ctx, ns.threads)
    text = os.path.abspath(ns.text)
    with open(text, "rb") as fb:
        digest = hashlib.sha256(fb.read()).hexdigest()
    shown = os.path.relpath(text, ROOT) if text.startswith(ROOT + os.sep) else text
    report = {"gguf": os.path.basename(gguf), "text": shown, "text_sha256": digest,
              "ctx": ns.ctx, "tokens": len(ids), "same_tokenization": own == ids,
              "tailserve": ours, "llama_cpp": theirs,
              "ratio": ours["ppl"] / theirs["ppl"], "gguf_weights": ns.gguf_weights}
    print(f"{report['gguf']}, {report['text']}: {len(ids)} tokens, {ours['chunks']} chunks of "
          f"{ns.ctx}, {ours['scored_tokens']} scored; tokenization "
          f"{'identical' if report['same_tokenization'] else 'DIFFERS'} to llama.cpp's")
    print(f"perplexity: tailserve ({ns.gguf_weights}) {ours['ppl']:.4f}, llama-perplexity "
          f"{theirs['ppl']:.4f} +/- {theirs['ppl_error']:.4f}: ratio {report['ratio']:.4f}")
    if ns.transformers:
        ref = transformers_perplexity(gguf, ids, ns.ctx)
        report["transformers"] = ref
        print(f"transformers (float32, the file dequantized): {ref['ppl']:.4f}; tailserve / "
              f"transformers {ours['ppl'] / ref['ppl']:.4f}, llama.cpp / transformers "
              f"{theirs['ppl'] / ref['ppl']:.4f}")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
