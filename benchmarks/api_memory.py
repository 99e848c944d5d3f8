"""The API process's memory over huge prompts: does it give back what a burst of them took?

Starts ``tailserve serve`` on a tiny random 2-layer Llama with an 8192-token context (the
SmolLM2 tokenizer; built into a temporary folder unless ``--model``), then sends ``--rounds``
bursts of ``--num-huge`` concurrent completions of ``--prompt-chars`` characters each (under
the byte bound, so each is tokenized, then refused as longer than max_model_len: the
tokenizing is the load). The API process's RSS (psutil) is printed before, at the peak of each
round, and ``--settle`` seconds after each round. Engine RSS is printed alongside.

    python benchmarks/api_memory.py                         # 5 rounds of 8 x 200,000 chars
    python benchmarks/api_memory.py --server-arg=--tokenizer-workers=4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import free_port, wait_for_health


def mb(p: psutil.Process) -> float:
    return p.memory_info().rss / 2**20


async def burst(url: str, text: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        rs = await asyncio.gather(*[
            client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
            for _ in range(n)
        ])
    return [r.status_code for r in rs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-huge", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=200_000)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--server-arg", action="append", default=[])
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tiny_models import build_tiny_llama

        model = build_tiny_llama(os.path.join(tempfile.mkdtemp(), "tiny8k"),
                                 max_position_embeddings=8192)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tailserve.cli", "serve", model, "--port", str(port),
           "--kv-cache-memory", "0.25", "--log-level", "warning", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        if not wait_for_health(url, proc, 180):
            raise SystemExit("the server did not start")
        api = psutil.Process(proc.pid)
        engine = next(c for c in api.children(recursive=True)
                      if "spawn_main" in " ".join(c.cmdline()))
        text = ("the quick brown fox jumps over the lazy dog " * (args.prompt_chars // 44 + 1))
        text = text[: args.prompt_chars]
        print(f"start: API {mb(api):.0f} MB, engine {mb(engine):.0f} MB "
              f"(load {os.getloadavg()[0]:.2f})")
        for r in range(args.rounds):
            peak = [0.0]
            stop = threading.Event()

            def sample(peak: list[float] = peak, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], mb(api))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            codes = asyncio.run(burst(url, text, args.num_huge))
            stop.set()
            sampler.join()
            time.sleep(args.settle)
            print(f"round {r}: statuses {sorted(set(codes))}; API peak {peak[0]:.0f} MB, "
                  f"after {args.settle:.0f} s {mb(api):.0f} MB; engine {mb(engine):.0f} MB")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
