"""One tenant floods, the other's first tokens: issue 34's isolation target, measured.

A quiet tenant sends Poisson arrivals (``--quiet-rate``, 64-token prompts, streamed); a
flooding tenant sends ``--flood-burst`` prompts of ``--flood-tokens`` tokens every
``--flood-period`` seconds, far beyond its half of the server. Three phases on a fresh server
each (the bundled model unless ``--model``), ``--seconds`` of quiet traffic in each:

  alone     -- the quiet tenant only: its P99 TTFT with no flood;
  one key   -- both tenants behind one key (one tenant to the server: first come);
  two keys  -- each its own key of weight 1 (``--api-keys``): fair share.

Reported per phase: the quiet tenant's requests, P50/P99 TTFT, its 429s; the flood's requests
served and refused. The target: two keys' P99 within 1.5x of alone's, and no quiet request
refused.

    python benchmarks/tenant_flood.py
    python benchmarks/tenant_flood.py --seconds 60 --phases alone two_keys
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import ServerProcess

KEYS = {"quiet": "sk-quiet-0123456789", "flood": "sk-flood-0123456789"}
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lamp", "forest", "ocean")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def words(rng: random.Random, n_tokens: int) -> str:
    # About one token per word for these words (SmolLM2's tokenizer); the server's own count
    # is what the report states.
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


async def ttft(client: httpx.AsyncClient, url: str, key: str, text: str,
               max_tokens: int) -> tuple[int, float | None]:
    body = {"prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    sent = time.monotonic()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - sent
    return 200, first


async def phase(url: str, args: argparse.Namespace, flood_key: str | None,
                quiet_key: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    quiet: list[tuple[int, float | None]] = []
    flood: list[int] = []

    async def one_quiet(client: httpx.AsyncClient) -> None:
        quiet.append(await ttft(client, url, quiet_key, words(rng, 64), 16))

    async def one_flood(client: httpx.AsyncClient) -> None:
        assert flood_key is not None
        status, _ = await ttft(client, url, flood_key, words(rng, args.flood_tokens), 8)
        flood.append(status)

    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        next_quiet = start + rng.expovariate(args.quiet_rate)
        next_flood = start if flood_key is not None else float("inf")
        while True:
            now = time.monotonic()
            if now - start >= args.seconds:
                break
            if now >= next_flood:
                tasks += [asyncio.create_task(one_flood(client))
                          for _ in range(args.flood_burst)]
                next_flood += args.flood_period
            if now >= next_quiet:
                tasks.append(asyncio.create_task(one_quiet(client)))
                next_quiet += rng.expovariate(args.quiet_rate)
            await asyncio.sleep(max(0.0, min(next_quiet, next_flood) - time.monotonic()))
        await asyncio.gather(*tasks)
    ttfts = [t for s, t in quiet if s == 200 and t is not None]
    return {
        "quiet_requests": len(quiet), "quiet_ok": len(ttfts),
        "quiet_refused": sum(s == 429 for s, _ in quiet),
        "quiet_other_status": sorted({s for s, _ in quiet} - {200, 429}),
        "quiet_p50_ttft_ms": _ms(percentile(ttfts, 50)),
        "quiet_p99_ttft_ms": _ms(percentile(ttfts, 99)),
        "flood_requests": len(flood), "flood_ok": sum(s == 200 for s in flood),
        "flood_refused": sum(s == 429 for s in flood),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--quiet-rate", type=float, default=0.5)
    p.add_argument("--flood-burst", type=int, default=24)
    p.add_argument("--flood-tokens", type=int, default=2000)
    p.add_argument("--flood-period", type=float, default=20.0)
    p.add_argument("--phases", nargs="+", default=["alone", "one_key", "two_keys"],
                   choices=["alone", "one_key", "two_keys"])
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for tailserve serve (repeat)")
    p.add_argument("--seed", type=int, default=34)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="tailserve-flood-")
    two = os.path.join(folder, "two.jsonl")
    with open(two, "w") as f:
        for name, key in KEYS.items():
            f.write(json.dumps({"key": key, "name": name}) + "\n")
    base = ["--max-model-len", str(max(4096, args.flood_tokens + 64)), "--max-queue-len", "32",
            "--kv-cache-memory", "1",
            *args.serve_arg]
    results = {}
    flood_key: str | None
    for name in args.phases:
        if name == "two_keys":
            serve, flood_key, quiet_key = [*base, "--api-keys", two], KEYS["flood"], KEYS["quiet"]
        else:
            serve = [*base, "--api-key", KEYS["quiet"]]
            flood_key = KEYS["quiet"] if name == "one_key" else None
            quiet_key = KEYS["quiet"]
        with ServerProcess(serve, model=args.model, startup_timeout=600) as srv:
            results[name] = asyncio.run(phase(srv.url, args, flood_key, quiet_key))
        print(name, json.dumps(results[name]), flush=True)
    alone = (results.get("alone") or {}).get("quiet_p99_ttft_ms")
    fair = (results.get("two_keys") or {}).get("quiet_p99_ttft_ms")
    if alone and fair:
        print(f"two keys' quiet P99 TTFT / alone's: {fair / alone:.2f}x (target <= 1.5x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
