"""Huge prompts against a running stream: /health and the stream's ITL while they tokenize.

One streaming completion runs; /health is polled back to back; after a warm-up, ``--num-huge``
completions of ``--prompt-chars`` of prose arrive at once (they are refused after tokenizing
when longer than max_model_len tokens, which is the point: the tokenizing is the load).
Reports the stream's ITL and /health latency P50/P99/max over the window the huge ones are in
flight. Run it against a server you started (``tailserve serve ... --port 8000``)::

    python benchmarks/tokenize_load.py --url http://127.0.0.1:8000 --prompt-chars 200000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np


def pct(xs: list[float]) -> str:
    if not xs:
        return "n=0"
    a = np.array(xs) * 1000
    return (f"n={len(a)} P50 {np.percentile(a, 50):.1f} ms, P99 {np.percentile(a, 99):.1f} ms, "
            f"max {a.max():.1f} ms")


async def main(args: argparse.Namespace) -> None:
    text = ("the quick brown fox jumps over the lazy dog " * (args.prompt_chars // 44 + 1))
    text = text[: args.prompt_chars]
    window: list[float] = []  # [start, end] of the huge requests
    async with httpx.AsyncClient(base_url=args.url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gaps: list[tuple[float, float]] = []  # (time of chunk, gap before it)

        async def stream() -> None:
            body = {"model": model, "prompt": "Hello", "max_tokens": args.stream_tokens,
                    "ignore_eos": True, "stream": True}
            last = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        json.loads(line[6:])
                        now = time.monotonic()
                        if last is not None:
                            gaps.append((now, now - last))
                        last = now

        health: list[tuple[float, float]] = []
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                await client.get("/health")
                health.append((t0, time.monotonic() - t0))

        async def huge() -> int:
            r = await client.post("/v1/completions",
                                  json={"model": model, "prompt": text, "max_tokens": 1})
            return r.status_code

        s = asyncio.create_task(stream())
        p = asyncio.create_task(poll())
        await asyncio.sleep(args.warmup)
        window.append(time.monotonic())
        codes = await asyncio.gather(*(huge() for _ in range(args.num_huge)))
        window.append(time.monotonic())
        await asyncio.sleep(0.2)
        stop.set()
        await p
        s.cancel()
    lo, hi = window
    print(f"{args.num_huge} x {args.prompt_chars} chars: statuses {sorted(set(codes))}, "
          f"all answered in {hi - lo:.2f} s")
    print("stream ITL during  :", pct([g for t, g in gaps if lo <= t <= hi + 0.2]))
    print("stream ITL before  :", pct([g for t, g in gaps if t < lo]))
    print("/health during     :", pct([d for t, d in health if lo <= t <= hi]))
    print("/health before     :", pct([d for t, d in health if t < lo]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompt-chars", type=int, default=200_000)
    ap.add_argument("--num-huge", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=4000)
    ap.add_argument("--warmup", type=float, default=1.0)
    asyncio.run(main(ap.parse_args()))
