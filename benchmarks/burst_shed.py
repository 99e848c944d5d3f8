"""Bursts shed fast: how long a refused request (429) and /health take while a burst arrives.

Starts ``tailserve serve`` (the bundled model unless ``--model``) with ``--max-num-seqs 4
--max-queue-len 8`` and measures, per round:

  health burst  -- ``--burst`` concurrent ``GET /health`` on the idle server;
  shed burst    -- ``--burst`` concurrent ``POST /v1/completions`` (``--max-tokens`` each):
                   12 are admitted, the rest get 429; /health is polled back to back during
                   the burst. Reported: the 429s' and the polls' latency.

Every request opens its own connection (``Connection: close``), as a burst of separate clients
does; a latency runs from just before the connect to the last byte of the answer. The client is
a few lines of asyncio streams (uvloop if installed) so that its own cost stays small.

``--pin`` runs the server on CPU 0 (``taskset -c 0``) and the client on the other CPUs;
without it both float over every core, as they would by default.

    python benchmarks/burst_shed.py                  # unpinned, 3 rounds
    python benchmarks/burst_shed.py --pin
    python benchmarks/burst_shed.py --url http://127.0.0.1:8000   # a server you started
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import free_port, wait_for_health


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def request(host: str, port: int, raw: bytes) -> tuple[int, float]:
    """One request on a fresh connection: (status, seconds from connect to the last byte)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(raw)
    data = await reader.read()  # Connection: close -> the server closes after the answer
    elapsed = time.perf_counter() - t0
    writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, elapsed


def raw_get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode()


def raw_post(path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode() + payload


async def health_burst(host: str, port: int, n: int) -> list[float]:
    results = await asyncio.gather(*[request(host, port, raw_get("/health")) for _ in range(n)])
    bad = [s for s, _ in results if s != 200]
    if bad:
        raise RuntimeError(f"/health answered {sorted(set(bad))} on an idle server")
    return [t for _, t in results]


async def shed_burst(
    host: str, port: int, n: int, max_tokens: int, capacity: int = 12
) -> tuple[dict[int, list[float]], list[float]]:
    """The burst's latencies by status, and /health's during it."""
    raw = raw_post("/v1/completions", {
        "prompt": "Tell me a story about a lighthouse.", "max_tokens": max_tokens,
        "ignore_eos": True,
    })
    polls: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            polls.append((await request(host, port, raw_get("/health")))[1])

    poller = asyncio.create_task(poll())
    tasks = [asyncio.create_task(request(host, port, raw)) for _ in range(n)]
    # The burst is over when every refusal is in: at most the capacity (12) can still be
    # running; the poller stops there and the admitted ones run their max_tokens on.
    by_status: dict[int, list[float]] = {}
    pending = set(tasks)
    while pending:
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in finished:
            status, elapsed = t.result()
            by_status.setdefault(status, []).append(elapsed)
        if len(pending) <= capacity:
            done.set()
    done.set()
    await poller
    return by_status, polls


def ms(xs: list[float]) -> str:
    return (f"P50 {1e3 * percentile(xs, 50):6.1f} ms  P99 {1e3 * percentile(xs, 99):6.1f} ms  "
            f"max {1e3 * max(xs):6.1f} ms  (n={len(xs)})") if xs else "n=0"


async def run(args: argparse.Namespace, host: str, port: int) -> dict[str, Any]:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    out: dict[str, Any] = {"rounds": []}
    for r in range(args.rounds):
        idle = await health_burst(host, port, args.burst)
        by_status, polls = await shed_burst(host, port, args.burst, args.max_tokens)
        refused = by_status.get(429, [])
        print(f"round {r}: statuses { {s: len(v) for s, v in sorted(by_status.items())} }")
        print(f"  idle /health burst : {ms(idle)}")
        print(f"  429s               : {ms(refused)}")
        print(f"  /health in burst   : {ms(polls)}")
        out["rounds"].append({"health_idle": idle, "refused": refused, "health_during": polls,
                              "statuses": {s: len(v) for s, v in by_status.items()}})
    idle = [x for rd in out["rounds"] for x in rd["health_idle"]]
    refused = [x for rd in out["rounds"] for x in rd["refused"]]
    polls = [x for rd in out["rounds"] for x in rd["health_during"]]
    print(f"all rounds: idle /health burst {ms(idle)}")
    print(f"            429s               {ms(refused)}")
    print(f"            /health in burst   {ms(polls)}")
    p99_ratio = percentile(refused, 99) / percentile(idle, 99)
    print(f"            429 P99 / idle /health-burst P99 = {p99_ratio:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model for the server (default: bundled)")
    ap.add_argument("--url", default=None, help="use this running server instead of starting one")
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pin", action="store_true",
                    help="server on CPU 0, the client on the others")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra flag for tailserve serve (repeatable)")
    ap.add_argument("--json", default=None, help="write the latencies here")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    proc = None
    if args.url is None:
        port = free_port()
        model = [args.model] if args.model else []
        cmd = [sys.executable, "-m", "tailserve.cli", "serve", *model, "--port",
               str(port), "--max-num-seqs", "4", "--max-queue-len", "8",
               "--kv-cache-memory", "0.5", "--log-level", "warning", *args.server_arg]
        if args.pin:
            cmd = ["taskset", "-c", str(cpus[0]), *cmd]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        if not wait_for_health(url, proc, 180):
            raise SystemExit("the server did not start")
    else:
        url = args.url
    if args.pin:
        os.sched_setaffinity(0, cpus[1:])
    host, port_s = url.removeprefix("http://").rsplit(":", 1)
    print(f"client CPUs {sorted(os.sched_getaffinity(0))}; server "
          f"{'CPU ' + str(cpus[0]) if args.pin else 'unpinned'}; load average "
          f"{os.getloadavg()[0]:.2f}")
    try:
        out = asyncio.run(run(args, host, int(port_s)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
