"""What tensor parallelism costs on this machine's CPU cores, and what ``plan`` predicts on GPUs.

Two random Llama folders whose heads split in two (the bundled SmolLM2-135M has 9 heads and 3
KV heads, which do not): ``tiny`` (tests/tiny_models.py: hidden 64, 2 layers, 4 heads / 2 KV)
and ``small`` (hidden 512, 24 layers, 8 heads / 4 KV heads of 64, intermediate 1536: about
SmolLM2-135M's size and cost per token); with ``--models ...,smollm2`` also the bundled
SmolLM2-135M GGUF as stored (packed Q4_1 blocks), which splits in 3 (``tp3``: three ranks on
two cores, one thread each). Each is served in-process by ``LLM``, in a fresh process per
setting:

    tp1     --tensor-parallel-size 1, all the cores' threads (2 here) in one process
    tp1-t1  --tensor-parallel-size 1 on one thread: what one rank of tp2 would do alone
    tp2     --tensor-parallel-size 2, one process per rank, the threads split (1 each)

and measured: single-stream decode TPOT (128-token prompt, 64 tokens), prompt tokens/s of a
512-token prompt (its prefill, one request), and 8 sequences decoding at once (output tok/s).
Best of ``--repeats``: the machine is shared. Then ``tailserve plan``'s per-device weights, KV
and decode roofline for Llama-3-8B and Llama-3-70B at T = 1, 2, 4, 8 on 80 GB H100s.

    python benchmarks/tensor_parallel.py [--repeats 3] [--models tiny,small] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SMALL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 24,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048}
# Public config.json shapes (the plan reads no weights).
LLAMA3 = {
    "Llama-3-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
    "Llama-3-70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
}


def measure(folder: str, tp: int, repeats: int, threads: int | None) -> dict[str, float]:
    """One setting, in this process (run by ``main`` in a child per setting)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    from tailserve import LLM, SamplingParams

    def prompt(n: int, seed: int) -> dict[str, list[int]]:
        g = torch.Generator().manual_seed(seed)
        return {"prompt_token_ids": torch.randint(200, 40000, (n,), generator=g).tolist()}

    def run(prompts: list[dict[str, list[int]]], tokens: int) -> list[dict[str, Any]]:
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return [o.timing[0] for o in llm.generate(prompts, sp)]

    extra: dict[str, Any] = {"gguf_weights": "packed"} if folder == "smollm2" else {}
    llm = LLM(None if folder == "smollm2" else folder, dtype="float32", tensor_parallel_size=tp,
              kv_cache_memory=0.25, max_model_len=2048, max_num_seqs=16,
              enable_prefix_caching=False, **extra)
    threads_used = torch.get_num_threads()  # this rank's, while the engine runs
    tpot, pps, batch = [], [], []
    try:
        run([prompt(16, 99)], 4)  # warm-up
        for r in range(repeats):
            t = run([prompt(128, r)], 64)[0]
            tpot.append(t["decode_s"] / (t["output_tokens"] - 1))
            t = run([prompt(512, 100 + r)], 1)[0]
            pps.append(512 / t["prefill_s"])
            ts = run([prompt(128, 200 + 8 * r + i) for i in range(8)], 32)
            batch.append(sum(x["output_tokens"] for x in ts) / max(x["e2e_s"] for x in ts))
    finally:
        llm.engine.close()
    return {"tpot_ms": min(tpot) * 1e3, "prompt_tok_s": max(pps), "batch8_out_tok_s": max(batch),
            "threads_per_rank": threads_used}


def plan_rows() -> list[dict[str, Any]]:
    from tailserve.analyze.plan import PlanInputs, make_plan
    from tailserve.config import ModelConfig

    rows = []
    for name, shape in LLAMA3.items():
        cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                                   "max_position_embeddings": 8192, "rope_theta": 500000.0,
                                   "tie_word_embeddings": False, **shape})
        for tp in (1, 2, 4, 8):
            p = make_plan(cfg, PlanInputs(model=name, tensor_parallel_size=tp,
                                          device_memory_gib=80, memory_bandwidth_gbs=3350,
                                          context=4096, batch=64))
            rows.append({"model": name, "tp": tp,
                         "weights_gib_per_device": p.weight_bytes_per_device / (1 << 30),
                         "kv_bytes_per_token_per_device": p.kv_bytes_per_token_per_device,
                         "kv_blocks_per_device": p.num_blocks,
                         "max_seqs_4k": p.max_concurrent_seqs,
                         "bf16_batch1_tok_s": p.decode_tokens_per_s["bf16"]["batch_1"],
                         "bf16_batch64_total_tok_s": p.decode_tokens_per_s["bf16"]["aggregate"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, metavar=("FOLDER", "TP", "THREADS"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        threads = int(a.child[2]) or None
        print(json.dumps(measure(a.child[0], int(a.child[1]), a.repeats, threads)))
        return
    from tiny_models import build_tiny_llama

    results: dict[str, Any] = {"serving": {}, "plan": plan_rows()}
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            settings = [("tp1", 1, 0), ("tp1-t1", 1, 1), ("tp2", 2, 0)]
            if model == "smollm2":  # 9 heads / 3 KV heads: 3 ranks, not 2
                folder = model
                settings[2] = ("tp3", 3, 0)
            else:
                shape = SMALL if model == "small" else {"max_position_embeddings": 2048}
                folder = build_tiny_llama(os.path.join(tmp, model), **shape)
            for name, tp, threads in settings:
                out = subprocess.run(
                    [sys.executable, __file__, "--repeats", str(a.repeats), "--child", folder,
                     str(tp), str(threads)], check=True, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                results["serving"][f"{model}/{name}"] = row
                print(f"{model:6s} {name:6s}: TPOT {row['tpot_ms']:.2f} ms, prompt "
                      f"{row['prompt_tok_s']:,.0f} tok/s, 8 seqs {row['batch8_out_tok_s']:,.0f} "
                      f"out tok/s ({row['threads_per_rank']} thread(s) per rank)", flush=True)
    print(f"\n{'plan (80 GiB, 3350 GB/s, ctx 4096)':38s} weights/dev KV B/tok/dev  seqs  "
          "tok/s b1  tok/s b64")
    for r in results["plan"]:
        print(f"{r['model']:14s} TP={r['tp']:<22d} {r['weights_gib_per_device']:8.2f} GiB "
              f"{r['kv_bytes_per_token_per_device']:11,d} {r['max_seqs_4k']:5d} "
              f"{r['bf16_batch1_tok_s']:8.1f} {r['bf16_batch64_total_tok_s']:10,.0f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
