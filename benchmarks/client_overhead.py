"""Client overhead: does ``tailserve bench`` distort what it measures?

The bench client (the real code path: ``run_bench``, the same as the CLI) is pointed at a
minimal local SSE responder in its own process, which answers every completion at once:
the first event is written the moment the request is parsed, the other ``--chunks`` events
right after it. Whatever the client then reports is the client's (and the loopback's) own
cost. The floor: the same requests from a blocking socket with no event loop and no HTTP
library (loopback, responder and process wake-ups only); the spinning floor: the same from a
non-blocking socket that spins before each send and on every read (no wake-up of the client
process at all), the floor for ``--busy-poll``. Phases, for each of the bench's HTTP clients
(``--http-clients``, default lean, lean with ``--busy-poll`` and aiohttp):

  1. latency at ``--rate`` (50) requests/s, Poisson arrivals, no progress bar.
     Target: client-added TTFT <= 1 ms at P99.
  2. the same with the live progress bar drawn (rich, to a terminal that is /dev/null),
     first client only.
  3. throughput: ``--num-prompts`` requests at rate inf, ``--max-concurrency`` in flight.
     Targets: >= 500 requests/s and >= 20,000 chunks/s.

On a shared machine the neighbours' load moves by the minute, so the latency phases and the
floor run **interleaved** in ``--blocks`` blocks (floor, spinning floor, each client, progress bar;
again), each block with the same arrival schedule for all of them, and their samples are
pooled: every variant sees the same load, and the floor is measured in the same run.

Client-added TTFT per request = measured TTFT − (responder's first write − responder's
receipt of the whole request). Both processes read CLOCK_MONOTONIC (``time.perf_counter`` on
Linux), so the remainder is exactly the client's send path, the loopback both ways and the
client's receive path. The responder returns its two stamps in the final chunk's
``tailserve_timing``, which the client keeps per request.

    python benchmarks/client_overhead.py                      # defaults below
    python benchmarks/client_overhead.py --num-prompts 2000 --latency-prompts 300 --json o.json
    python benchmarks/client_overhead.py --pin      # responder on CPU 1, everything else on 0
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import socket
import subprocess
import sys
import time
import typing
from typing import Any, Literal

import numpy as np

# ---------------------------------------------------------------- the responder


def _chunk(text: str, finish: str | None) -> bytes:
    event = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "responder",
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish, "stop_reason": None}]}
    body = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(body), body)  # one HTTP/1.1 chunk


class Responder(asyncio.Protocol):
    HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")
    MODELS = json.dumps({"object": "list", "data": [{"id": "responder"}]}).encode()
    chunks = 40
    first: bytes  # the head and the first chunk, built by the first connection
    rest: bytes

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""
        cls = type(self)
        if not hasattr(cls, "first"):
            cls.first = cls.HEAD + _chunk(" t", None)
            cls.rest = b"".join(_chunk(" t", None) for _ in range(cls.chunks - 2)) + _chunk(
                " t", "length")

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            self.answer(head.split(" ", 2))

    def answer(self, request_line: list[str]) -> None:
        method, path = request_line[0], request_line[1]
        if method == "POST" and path == "/v1/completions":
            recv = time.perf_counter()
            first_write = time.perf_counter()
            self.transport.write(self.first)
            usage = {"choices": [], "usage": {"prompt_tokens": 1,
                                              "completion_tokens": self.chunks},
                     "tailserve_timing": {"recv": recv, "first_write": first_write}}
            tail = b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"
            self.transport.write(self.rest + b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
        elif method == "GET" and path == "/v1/models":
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(self.MODELS),
                                                                    self.MODELS))
        else:  # no /tokenize, /metrics or timeline: the bench treats it as another server
            self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")


def serve_responder(port: int, chunks: int) -> None:
    Responder.chunks = chunks

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Responder, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# ---------------------------------------------------------------- the phases
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_block(url: str, n: int, rate: float, max_concurrency: int | None, progress: bool,
                seed: int, variant: str) -> dict[str, Any]:
    """One ``run_bench`` step; the raw per-request samples, for pooling across blocks.
    ``variant``: an ``--http-client`` name, ``+busy`` for ``--busy-poll``."""
    name, _, extra = variant.partition("+")
    if name not in ("lean", "aiohttp"):
        raise ValueError(f"--http-clients: {name!r} is not lean or aiohttp")
    http_client = typing.cast(Literal["lean", "aiohttp"], name)
    busy_poll = extra == "busy"
    from rich.console import Console

    from tailserve.bench.config import BenchConfig
    from tailserve.bench.datasets import DatasetOptions
    from tailserve.bench.run import run_bench

    if progress:  # a real terminal's redraws, thrown away
        console = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
    else:
        console = Console(file=io.StringIO(), width=120)
    cfg = BenchConfig(base_url=url, request_rate=rate, max_concurrency=max_concurrency,
                      seed=seed, progress=progress, observe=False, percentiles=[50, 99],
                      http_client=http_client, busy_poll=busy_poll,
                      dataset=DatasetOptions(num_prompts=n, input_len=32, output_len=40))
    [r] = run_bench(cfg, console)
    ts = r["tailserve"]
    assert ts["environment"]["http_client"] == http_client
    assert ts["environment"]["busy_poll"] == busy_poll
    t0 = ts["start_perf_counter"]
    out: dict[str, Any] = {"ttft": [], "added": [], "send_path": [], "receive_path": [],
                           "lag": [], "chunks": 0, "completed": r["completed"],
                           "failed": r["failed"], "duration": r["duration"]}
    for q in ts["requests"]:
        out["lag"].append(q["lag_s"])
        if q["error_type"] is not None:
            continue
        st = q["server_timing"]
        sent = t0 + q["send_s"]
        out["ttft"].append(q["ttft_s"])
        out["added"].append(q["ttft_s"] - (st["first_write"] - st["recv"]))
        out["send_path"].append(st["recv"] - sent)
        out["receive_path"].append(sent + q["ttft_s"] - st["first_write"])
        out["chunks"] += 1 + len(q["itl_s"])
    return out


def floor_block(port: int, n: int, rate: float, seed: int, spin: bool = False
                ) -> dict[str, Any]:
    """The floor: the same requests at the same Poisson rate from a blocking socket, no event
    loop and no HTTP library. What this measures is loopback, the responder and the operating
    system waking processes up; whatever the bench measures above it is the bench's own.
    ``spin``: a non-blocking socket, a spin for the last 2 ms before each send (as
    ``--busy-poll`` does) and a spin on ``recv``: this process is never woken up, only the
    responder is — the floor for the busy-poll client."""
    from tailserve.bench.open_loop import arrival_times

    body = json.dumps({"model": "responder", "prompt": " ".join(["word"] * 32),
                       "max_tokens": 40, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    # The bench's own schedule for this seed (bench/step.py draws it from (seed, step 0, 1)).
    arrivals = arrival_times(n, rate, 1.0, np.random.default_rng([seed, 0, 1]))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as both bench clients do
    sock.setblocking(not spin)

    def recv() -> bytes:
        while True:
            try:
                return sock.recv(1 << 16)
            except BlockingIOError:  # spin: nothing yet; the CPU to whoever waits for it
                os.sched_yield()

    ttft, added, send_path, recv_path = [], [], [], []
    t0 = time.perf_counter()
    for t in arrivals:
        while (delay := t0 + t - time.perf_counter()) > 0:
            if not spin:
                time.sleep(delay)
            elif delay > 0.002:
                time.sleep(delay - 0.002)
            else:
                os.sched_yield()
        sent = time.perf_counter()
        sock.sendall(request)  # a few hundred bytes: the empty send buffer takes them at once
        buf = recv()
        first = time.perf_counter()
        while not buf.endswith(b"0\r\n\r\n"):
            buf += recv()
        stamps = json.loads(buf.split(b'"tailserve_timing": ', 1)[1].split(b"}", 1)[0] + b"}")
        ttft.append(first - sent)
        added.append(first - sent - (stamps["first_write"] - stamps["recv"]))
        send_path.append(stamps["recv"] - sent)
        recv_path.append(first - stamps["first_write"])
    sock.close()
    return {"ttft": ttft, "added": added, "send_path": send_path, "receive_path": recv_path}


def _ms(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1000.0
    if a.size == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def pooled(name: str, blocks: list[dict[str, Any]], requests: int,
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> dict[str, Any]:
    """One phase's figures over all its blocks' samples."""
    cat = {k: [v for b in blocks for v in b[k]] for k in blocks[0] if isinstance(blocks[0][k],
                                                                                 list)}
    out: dict[str, Any] = {"phase": name, "requests": requests, "blocks": len(blocks),
                           "ttft_ms": _ms(cat["ttft"]), "client_added_ttft_ms": _ms(cat["added"]),
                           "load_average_before": load[0], "load_average_after": load[1]}
    if "send_path" in cat:
        out |= {"send_path_ms": _ms(cat["send_path"]),
                "receive_path_ms": _ms(cat["receive_path"])}
    if "completed" in blocks[0]:
        duration = sum(b["duration"] for b in blocks)
        out |= {"completed": sum(b["completed"] for b in blocks),
                "failed": sum(b["failed"] for b in blocks), "duration_s": duration,
                "requests_per_s": sum(b["completed"] for b in blocks) / duration,
                "chunks_per_s": sum(b["chunks"] for b in blocks) / duration,
                "send_lag_ms": _ms(cat["lag"])}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responder", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--chunks", type=int, default=40, help="content chunks per response")
    ap.add_argument("--num-prompts", type=int, default=5000, help="throughput phase")
    ap.add_argument("--max-concurrency", type=int, default=32, help="throughput phase")
    ap.add_argument("--rate", type=float, default=50.0, help="latency phases, requests/s")
    ap.add_argument("--latency-prompts", type=int, default=1000,
                    help="latency phase and floor, per client, over all blocks")
    ap.add_argument("--progress-prompts", type=int, default=500,
                    help="latency phase with the progress bar, over all blocks")
    ap.add_argument("--blocks", type=int, default=10,
                    help="interleaved blocks of the latency phases and the floor")
    ap.add_argument("--http-clients", default="lean,lean+busy,aiohttp",
                    help="the bench's HTTP clients to measure, side by side; +busy: with "
                    "--busy-poll (default: %(default)s); the progress-bar phase uses the first")
    ap.add_argument("--pin", action="store_true",
                    help="pin the responder to CPU 1 and this process (the clients and "
                    "floors) to CPU 0")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.responder:
        serve_responder(args.port, args.chunks)
        return 0

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--responder", "--port", str(port),
                             "--chunks", str(args.chunks)])
    if args.pin:
        os.sched_setaffinity(proc.pid, {1})
        os.sched_setaffinity(0, {0})
    clients = [c.strip() for c in args.http_clients.split(",") if c.strip()]
    nb = max(1, args.blocks)
    per, per_progress = args.latency_prompts // nb, args.progress_prompts // nb
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the responder did not start") from None
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        floor: list[dict[str, Any]] = []
        spin_floor: list[dict[str, Any]] = []
        latency: dict[str, list[dict[str, Any]]] = {c: [] for c in clients}
        bar: list[dict[str, Any]] = []
        load_before = os.getloadavg()
        for b in range(nb):
            seed = 100 + b  # one arrival schedule per block, the same for every variant
            floor.append(floor_block(port, per, args.rate, seed))
            spin_floor.append(floor_block(port, per, args.rate, seed, spin=True))
            for c in clients:
                latency[c].append(bench_block(url, per, args.rate, None, False, seed, c))
            if per_progress:
                bar.append(bench_block(url, per_progress, args.rate, None, True, seed,
                                       clients[0]))
        load = (load_before, os.getloadavg())
        rate = f"{args.rate:g} req/s"
        phases = [pooled(f"latency @ {rate} [{c}]", latency[c], per * nb, load)
                  for c in clients]
        if bar:
            phases.append(pooled(f"latency @ {rate}, progress bar [{clients[0]}]", bar,
                                 per_progress * nb, load))
        floor_phase = pooled(f"floor: blocking socket @ {rate}", floor, per * nb, load)
        spin_floor_phase = pooled(f"floor: spinning socket @ {rate}", spin_floor, per * nb,
                                  load)
        for c in clients:
            before = os.getloadavg()
            blk = bench_block(url, args.num_prompts, float("inf"), args.max_concurrency, False,
                              0, c)
            phases.append(pooled(f"throughput [{c}]", [blk], args.num_prompts,
                                 (before, os.getloadavg())))
    finally:
        proc.terminate()
        proc.wait(10)
    out = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                       "cpu_count": os.cpu_count()},
           "chunks_per_response": args.chunks, "blocks": nb, "pinned": args.pin,
           "floor": floor_phase, "spinning_floor": spin_floor_phase,
           "phases": phases}
    print("| phase | req/s | chunks/s | TTFT ms P50 / P99 / max | client-added TTFT ms P50 / "
          "P90 / P99 / max | send path / receive path ms P50 · P99 | send lag ms P99 | "
          "load avg (1 min) before → after |")
    print("|---|---|---|---|---|---|---|---|")
    for p in [*phases, floor_phase, spin_floor_phase]:
        t, a = p["ttft_ms"], p["client_added_ttft_ms"]
        ok = f"{p['completed']}/{p['requests']} ok" if "completed" in p else p["requests"]
        row = (f"| {p['phase']} ({ok}) | "
               + (f"{p['requests_per_s']:,.0f} | {p['chunks_per_s']:,.0f} | "
                  if "completed" in p else "| | ")
               + f"{t['p50']:.3f} / {t['p99']:.3f} / {t['max']:.3f} | "
               f"{a['p50']:.3f} / {a['p90']:.3f} / {a['p99']:.3f} / {a['max']:.3f} | ")
        row += (f"{p['send_path_ms']['p50']:.3f} / {p['receive_path_ms']['p50']:.3f} · "
                f"{p['send_path_ms']['p99']:.3f} / {p['receive_path_ms']['p99']:.3f} | ")
        row += f"{p['send_lag_ms']['p99']:.2f} | " if "completed" in p else "| "
        row += (f"{p['load_average_before'][0]:.2f} → {p['load_average_after'][0]:.2f} |")
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
