"""``tailserve watch URL``: scrape a running server every ``--interval`` seconds and print each
window (rich, or ``--json`` lines); ``--dashboard PORT`` serves the live dashboard page fed
by the same windows.

Why a port of its own rather than a view inside ``tailserve serve``'s ``/dashboard``: that
page is built in the server's API process from its engine's messages, so it can only show
tailserve itself; watch is for any engine (a vLLM fleet is not ours), so the page has to be
served by the process that watches. It is the same page (server/dashboard), fed the same
sample shape through the same SSE route, with a watch panel that shows only when the samples
carry watch's SLO shares and causes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HISTORY = 60  # samples a new page replays (the page keeps 60)
KEEPALIVE_S = 15.0
FAILURES_TO_EXIT = 3  # consecutive failed scrapes: the server is gone, exit 1


class WatchBoard:
    """``/dashboard`` and ``/dashboard/events`` on a port of watch's own (module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self.history: deque[str] = deque(maxlen=HISTORY)
        self.seq = 0
        self.cond = threading.Condition()
        self.closed = False
        board = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # the terminal is watch's output, not an access log

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/dashboard":
                    from tailserve.server.dashboard import page_html

                    body = page_html().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html; charset=utf-8")
                    self.send_header("Cache-Control", "no-store")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif path == "/dashboard/events":
                    board.stream(self)
                else:
                    self.send_error(404, "watch serves /dashboard only")

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def publish(self, sample: dict[str, Any]) -> None:
        with self.cond:
            self.history.append(json.dumps(sample, separators=(",", ":")))
            self.seq += 1
            self.cond.notify_all()

    def stream(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-store")
        h.end_headers()
        with self.cond:
            past, seen = list(self.history), self.seq
        try:
            h.wfile.write(b"retry: 2000\n\n")
            if past:
                h.wfile.write(("event: history\ndata: [" + ",".join(past) + "]\n\n").encode())
            h.wfile.flush()
            while not self.closed:
                with self.cond:
                    if self.seq == seen and not self.closed:
                        self.cond.wait(KEEPALIVE_S)
                    new = list(self.history)[-(self.seq - seen):] if self.seq != seen else []
                    seen = self.seq
                out = "".join(f"data: {d}\n\n" for d in new) or ": keep-alive\n\n"
                h.wfile.write(out.encode())
                h.wfile.flush()
        except OSError:
            return  # the page went away

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


def _cmd_watch(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.watch.scrape import Fetcher, WatchError
    from tailserve.analyze.watch.view import dashboard_sample, header, print_window
    from tailserve.analyze.watch.watcher import Watcher
    from tailserve.bench.gpu import GpuWatermark
    from tailserve.errors import check_slo_ms

    if not 0 < ns.interval < float("inf"):
        raise WatchError(f"--interval must be a positive number of seconds, got {ns.interval:g}")
    slos: dict[str, float] = {}
    for kind in ("ttft", "itl"):
        v = getattr(ns, f"slo_{kind}_ms")
        if v is not None:
            check_slo_ms(f"--slo-{kind}-ms", v, WatchError)
            slos[kind] = v / 1e3
    if ns.windows is not None and ns.windows < 1:
        raise WatchError(f"--windows must be >= 1, got {ns.windows}")
    watcher = Watcher(Fetcher(ns.url, ns.api_key), slos,
                      None if ns.no_gpu else GpuWatermark(), timeline=not ns.no_timeline)
    watcher.start()
    # With --json, stdout carries the JSON lines only; the rest goes to stderr.
    console = Console(stderr=ns.json, highlight=False, soft_wrap=True)  # a line per window
    for line in header(ns.url, watcher.engine.name, ns.interval, slos, watcher.notes):
        console.print(line, markup=False)
    board = None
    if ns.dashboard is not None:
        board = WatchBoard(ns.dashboard_host, ns.dashboard)
        console.print(f"dashboard: http://{ns.dashboard_host}:{board.port}/dashboard",
                      markup=False)
    preemptions = 0.0
    alerts = failures = done = 0
    next_at = time.monotonic() + ns.interval
    try:
        while ns.windows is None or done < ns.windows:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + ns.interval, time.monotonic())
            try:
                w = watcher.step()
            except WatchError as exc:
                failures += 1
                console.print(f"scrape failed ({failures} in a row): {exc}", markup=False)
                if failures >= FAILURES_TO_EXIT:
                    console.print("error: the server stopped answering; watch ends",
                                  markup=False)
                    return 1
                continue
            failures = 0
            done += 1
            preemptions += w.signals.get("preemptions", 0.0)
            alerts += int(w.gpu_alert)
            if ns.json:
                sys.stdout.write(json.dumps(w.as_json()) + "\n")
                sys.stdout.flush()
            else:
                print_window(console, w)
            if board is not None:
                board.publish(dashboard_sample(w, preemptions, alerts, ns.url))
    except KeyboardInterrupt:
        pass
    finally:
        if board is not None:
            board.close()
    return 0


def add_watch(sub: Any) -> None:
    w = sub.add_parser(
        "watch", help="a running server's live SLO board (no load sent)",
        description="Scrape a running server's /metrics (tailserve, vLLM, SGLang, "
        "llama-server) every --interval seconds, and tailserve's step timeline; per window "
        "show the share of requests within the SLO and the P99 of TTFT and ITL from the "
        "histograms' bucket deltas, and name the likely cause when a window's P99 jumps "
        "above the earlier windows' level. Exit 2 on bad input (no server at URL, no "
        "Prometheus page, an unknown engine), 1 when the server stops answering.",
    )
    w.add_argument("url", metavar="URL", help="the server's base URL, http://HOST:PORT")
    w.add_argument("--interval", type=float, default=5.0, metavar="S",
                   help="seconds between scrapes: one window each (default: 5)")
    w.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="TTFT SLO: the share of requests within it, per window")
    w.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="ITL SLO: the share of token gaps within it, per window")
    w.add_argument("--json", action="store_true",
                   help="one JSON object per window on stdout (for alerting)")
    w.add_argument("--windows", type=int, default=None, metavar="N",
                   help="stop after N windows (default: until interrupted)")
    w.add_argument("--dashboard", type=int, default=None, metavar="PORT",
                   help="serve the live dashboard page at http://HOST:PORT/dashboard "
                   "(0: any free port)")
    w.add_argument("--dashboard-host", default="127.0.0.1", metavar="HOST",
                   help="the address the dashboard listens on (default: 127.0.0.1)")
    w.add_argument("--api-key", default=None, metavar="KEY",
                   help="a bearer key for the server, if its timeline needs one")
    w.add_argument("--no-timeline", action="store_true",
                   help="do not read tailserve's /debug/timeline")
    w.add_argument("--no-gpu", action="store_true",
                   help="do not read the GPU memory watermark through NVML")
    w.set_defaults(func=_cmd_watch)
