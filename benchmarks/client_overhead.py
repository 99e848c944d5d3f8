"""Client overhead: does ``tailserve bench`` distort what it measures?

The bench client (the real code path: ``run_bench``, the same as the CLI) is pointed at a
minimal local SSE responder in its own process, which answers every completion at once:
the first event is written the moment the request is parsed, the other ``--chunks`` events
right after it. Whatever the client then reports is the client's (and the loopback's) own
cost. First the floor: the same requests from a blocking socket with no event loop and no
HTTP library (loopback, responder and process wake-ups only). Then three phases:

  1. throughput: ``--num-prompts`` requests at rate inf, ``--max-concurrency`` in flight.
     Targets: >= 500 requests/s and >= 20,000 chunks/s.
  2. latency at ``--rate`` (50) requests/s, Poisson arrivals, no progress bar.
     Target: client-added TTFT <= 1 ms at P99.
  3. the same with the live progress bar drawn (rich, to a terminal that is /dev/null).

Client-added TTFT per request = measured TTFT − (responder's first write − responder's
receipt of the whole request). Both processes read CLOCK_MONOTONIC (``time.perf_counter`` on
Linux), so the remainder is exactly the client's send path, the loopback both ways and the
client's receive path. The responder returns its two stamps in the final chunk's
``tailserve_timing``, which the client keeps per request.

    python benchmarks/client_overhead.py                      # defaults below
    python benchmarks/client_overhead.py --num-prompts 2000 --latency-prompts 300 --json o.json
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
from typing import Any

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


def run_phase(url: str, name: str, n: int, rate: float, max_concurrency: int | None,
              progress: bool, seed: int, http_client: str) -> dict[str, Any]:
    from rich.console import Console

    from tailserve.bench.datasets import DatasetOptions
    from tailserve.bench.run import BenchConfig, run_bench

    if progress:  # a real terminal's redraws, thrown away
        console = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
    else:
        console = Console(file=io.StringIO(), width=120)
    cfg = BenchConfig(base_url=url, request_rate=rate, max_concurrency=max_concurrency,
                      seed=seed, progress=progress, observe=False, percentiles=[50, 99],
                      http_client=http_client,
                      dataset=DatasetOptions(num_prompts=n, input_len=32, output_len=40))
    load_before = os.getloadavg()
    [r] = run_bench(cfg, console)
    ts = r["tailserve"]
    reqs = ts["requests"]
    t0 = ts["start_perf_counter"]
    ttft, added, send_path, recv_path = [], [], [], []
    for q in reqs:
        if q["error_type"] is not None:
            continue
        st = q["server_timing"]
        sent = t0 + q["send_s"]
        first = sent + q["ttft_s"]
        ttft.append(q["ttft_s"])
        added.append(q["ttft_s"] - (st["first_write"] - st["recv"]))
        send_path.append(st["recv"] - sent)
        recv_path.append(first - st["first_write"])
    chunks = sum(1 + len(q["itl_s"]) for q in reqs if q["error_type"] is None)

    def ms(values: list[float]) -> dict[str, float]:
        a = np.asarray(values) * 1000.0
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                "max": float(a.max())}

    return {
        "phase": f"{name} [{http_client}]", "http_client": http_client, "requests": n,
        "rate": rate, "max_concurrency": max_concurrency,
        "progress_bar": progress, "completed": r["completed"], "failed": r["failed"],
        "duration_s": r["duration"], "requests_per_s": r["request_throughput"],
        "chunks_per_s": chunks / r["duration"],
        "ttft_ms": ms(ttft), "client_added_ttft_ms": ms(added),
        "send_path_ms": ms(send_path), "receive_path_ms": ms(recv_path),
        "send_lag_ms": {"p99": ts["send_lag_ms"]["p99"], "max": ts["send_lag_ms"]["max"]},
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }


def baseline_phase(port: int, n: int, rate: float, seed: int) -> dict[str, Any]:
    """The floor: the same requests at the same Poisson rate from a blocking socket, no event
    loop and no HTTP library. What this measures is loopback, the responder and the operating
    system waking processes up; whatever the bench measures above it is the bench's own."""
    from tailserve.bench.run import arrival_times

    body = json.dumps({"model": "responder", "prompt": " ".join(["word"] * 32),
                       "max_tokens": 40, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    arrivals = arrival_times(n, rate, 1.0, np.random.default_rng(seed))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as aiohttp does
    ttft, added = [], []
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    for t in arrivals:
        while (delay := t0 + t - time.perf_counter()) > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        sock.sendall(request)
        buf = sock.recv(1 << 16)
        first = time.perf_counter()
        while not buf.endswith(b"0\r\n\r\n"):
            buf += sock.recv(1 << 16)
        stamps = json.loads(buf.split(b'"tailserve_timing": ', 1)[1].split(b"}", 1)[0] + b"}")
        ttft.append(first - sent)
        added.append(first - sent - (stamps["first_write"] - stamps["recv"]))
    sock.close()

    def ms(values: list[float]) -> dict[str, float]:
        a = np.asarray(values) * 1000.0
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                "max": float(a.max())}

    return {"phase": f"floor: blocking socket @ {rate:g} req/s", "requests": n,
            "ttft_ms": ms(ttft), "client_added_ttft_ms": ms(added),
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responder", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--chunks", type=int, default=40, help="content chunks per response")
    ap.add_argument("--num-prompts", type=int, default=5000, help="throughput phase")
    ap.add_argument("--max-concurrency", type=int, default=32, help="throughput phase")
    ap.add_argument("--rate", type=float, default=50.0, help="latency phases, requests/s")
    ap.add_argument("--latency-prompts", type=int, default=1000, help="latency phase")
    ap.add_argument("--progress-prompts", type=int, default=500,
                    help="latency phase with the progress bar")
    ap.add_argument("--http-clients", default="lean,aiohttp",
                    help="the bench's HTTP clients to measure, side by side (default: "
                    "%(default)s); the progress-bar phase uses the first")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.responder:
        serve_responder(args.port, args.chunks)
        return 0

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--responder", "--port", str(port),
                             "--chunks", str(args.chunks)])
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
        clients = [c.strip() for c in args.http_clients.split(",") if c.strip()]
        # The floor first and last: the machine is shared, and the two show how much the
        # neighbours' load moved during the run.
        floors = [baseline_phase(port, args.latency_prompts, args.rate, 1)]
        phases = [run_phase(url, f"latency @ {args.rate:g} req/s", args.latency_prompts,
                            args.rate, None, False, 1, c) for c in clients]
        phases += [run_phase(url, "throughput", args.num_prompts, float("inf"),
                             args.max_concurrency, False, 0, c) for c in clients]
        phases.append(run_phase(url, f"latency @ {args.rate:g} req/s, progress bar",
                                args.progress_prompts, args.rate, None, True, 2, clients[0]))
        floors.append(baseline_phase(port, args.latency_prompts, args.rate, 1))
        floors[0]["phase"] += " (first)"
        floors[1]["phase"] += " (last)"
    finally:
        proc.terminate()
        proc.wait(10)
    out = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                       "cpu_count": os.cpu_count()},
           "chunks_per_response": args.chunks, "floors": floors, "phases": phases}
    print("| phase | req/s | chunks/s | TTFT ms P50 / P99 / max | client-added TTFT ms P50 / "
          "P99 / max | of which send path / receive path ms P50 · P99 | send lag ms P99 | "
          "load avg (1 min) before → after |")
    print("|---|---|---|---|---|---|---|---|")
    for p in phases:
        t, a = p["ttft_ms"], p["client_added_ttft_ms"]
        print(f"| {p['phase']} ({p['completed']}/{p['requests']} ok) | "
              f"{p['requests_per_s']:,.0f} | {p['chunks_per_s']:,.0f} | "
              f"{t['p50']:.3f} / {t['p99']:.3f} / {t['max']:.3f} | "
              f"{a['p50']:.3f} / {a['p99']:.3f} / {a['max']:.3f} | "
              f"{p['send_path_ms']['p50']:.3f} / {p['receive_path_ms']['p50']:.3f} · "
              f"{p['send_path_ms']['p99']:.3f} / {p['receive_path_ms']['p99']:.3f} | "
              f"{p['send_lag_ms']['p99']:.2f} | "
              f"{p['load_average_before'][0]:.2f} → {p['load_average_after'][0]:.2f} |")
    for floor in floors:
        t, a = floor["ttft_ms"], floor["client_added_ttft_ms"]
        print(f"| {floor['phase']} ({floor['requests']}) | | | "
              f"{t['p50']:.3f} / {t['p99']:.3f} / {t['max']:.3f} | "
              f"{a['p50']:.3f} / {a['p99']:.3f} / {a['max']:.3f} | | | "
              f"{floor['load_average_before'][0]:.2f} → {floor['load_average_after'][0]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
