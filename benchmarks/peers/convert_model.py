"""Write the shared GGUF model as a Hugging Face folder vLLM can load.

Runs in the vLLM venv (needs transformers, gguf, accelerate). transformers dequantizes the GGUF
on load but refuses to save a GGUF-loaded model, so the weights are copied into a fresh
LlamaForCausalLM built from the same config (without its quantization_config) and that is saved.
"""

from __future__ import annotations

import argparse
import os
import sys


def convert(gguf: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    fresh = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head may be absent from the GGUF state and re-tied on save.
    real_missing = [k for k in missing if k != "lm_head.weight"]
    if real_missing or unexpected:
        raise SystemExit(f"weights do not match: missing {real_missing}, unexpected {unexpected}")
    os.makedirs(out, exist_ok=True)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", required=True, help="the shared .gguf model file")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    args = parser.parse_args()
    if os.path.isfile(os.path.join(args.out, "config.json")):
        print(f"model folder already there: {args.out}")
        return
    convert(args.gguf, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
