#!/usr/bin/env python3
"""N ``tailserve serve`` replicas on loopback with vllm-router in front of them.

    python deploy/router/serve_replicas.py --replicas 2 --policy cache_aware -- --max-num-seqs 16
    curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 8}'

Replica ``i`` listens on ``--replica-base-port + i`` with ``--threads / --replicas`` compute
threads (``OMP_NUM_THREADS``), so the replicas share the cores instead of each taking all of
them; the router (``--policy``, vllm-router's names) listens on ``--port``. Everything after
``--`` goes to every ``tailserve serve`` (a model path, engine flags). With ``--kv-events``
each replica publishes its KV-cache events (``--kv-events-config``) on
``--kv-events-base-port + i`` and the router, with ``--policy kv_aware``, subscribes to them.

``--state-file`` receives, once everything answers, a JSON object with the router's URL and
each replica's URL, pid and events endpoint (for tests and scripts). Ctrl-C or SIGTERM stops
the router, then drains the replicas (their own SIGTERM handling). A replica that dies stays
dead: the router's health checks take it out of rotation, which is the point of having two.

The router is the ``vllm-router`` executable (``pip install vllm-router``) next to this
Python, on ``PATH``, or ``--router-bin``. Stdlib only, so the script runs from any checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Replica:
    url: str
    pid: int
    kv_events_endpoint: str | None  # what a subscriber connects to, None when off


def find_router(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return str(beside)
    return shutil.which("vllm-router")


def healthy(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was up")
        if healthy(url):
            return
        time.sleep(0.25)
    raise RuntimeError(f"{what} was not healthy at {url}/health within {timeout_s:.0f} s")


def split_threads(total: int, n: int) -> list[int]:
    """``total`` threads over ``n`` replicas, at least one each; the remainder to the first."""
    base, extra = divmod(max(total, n), n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def replica_command(args: argparse.Namespace, i: int, serve_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "tailserve.cli", "serve", *serve_args,
           "--host", args.host, "--port", str(args.replica_base_port + i)]
    if args.kv_events:
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://*:{args.kv_events_base_port + i}", "topic": "kv-events"}
        cmd += ["--kv-events-config", json.dumps(cfg)]
    return cmd


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_command(
    args: argparse.Namespace, router_bin: str, replicas: list[Replica]
) -> list[str]:
    cmd = [router_bin, "--host", args.host, "--port", str(args.port),
           "--policy", args.policy, "--worker-urls", *[r.url for r in replicas],
           # Workers are up already; do not wait the default 30 s between start-up checks.
           "--worker-startup-check-interval", "1",
           # A dead replica leaves the rotation after two failed checks a second apart.
           "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
           "--health-check-endpoint", "/health", "--log-level", args.router_log_level,
           # vLLM-router's own default (29000) is one port for every router on the host: a
           # second router (a test beside a soak) died with "Address already in use".
           "--prometheus-port", str(getattr(args, "router_metrics_port", None) or _free_port())]
    if args.policy == "kv_aware":
        for r in replicas:
            if r.kv_events_endpoint is not None:
                cmd += ["--kv-event-source", f"{r.url}={r.kv_events_endpoint}"]
        cmd += ["--kv-event-block-size", str(args.block_size),
                "--kv-event-model", args.kv_event_model]
    return cmd + args.router_arg


def replica_envs(items: list[str], n: int) -> dict[int, dict[str, str]]:
    """``["1:A=x", "1:B=y"]`` -> ``{1: {"A": "x", "B": "y"}}``."""
    out: dict[int, dict[str, str]] = {}
    for item in items:
        index, _, assign = item.partition(":")
        name, eq, value = assign.partition("=")
        if not index.isdigit() or not name or not eq:
            raise ValueError(f"--replica-env wants I:NAME=VALUE, got {item!r}")
        if int(index) >= n:
            raise ValueError(f"--replica-env {item!r}: replica {index} of {n} (0-based)")
        out.setdefault(int(index), {})[name] = value
    return out


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--replica-base-port", type=int, default=8100)
    p.add_argument("--policy", default="cache_aware",
                   help="vllm-router's --policy: cache_aware, kv_aware, round_robin, ...")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="compute threads of all replicas together")
    p.add_argument("--kv-events", action="store_true",
                   help="replicas publish KV-cache events (kv_aware consumes them)")
    p.add_argument("--kv-events-base-port", type=int, default=5557)
    p.add_argument("--block-size", type=int, default=16,
                   help="the replicas' --block-size, for the router's KV-event index")
    p.add_argument("--kv-event-model", default="SmolLM2-135M-Instruct",
                   help="kv_aware: the model identity (or tokenizer folder) vllm-router keys "
                   "the replicas' events by")
    p.add_argument("--router-bin", default=None)
    p.add_argument("--router-arg", action="append", default=[],
                   help="one more argument for vllm-router (repeat)")
    p.add_argument("--router-log-level", default="warning")
    p.add_argument("--router-metrics-port", type=int, default=None,
                   help="vllm-router's Prometheus port (default: a free one)")
    p.add_argument("--replica-env", action="append", default=[], metavar="I:NAME=VALUE",
                   help="an environment variable for replica I only (repeat), e.g. "
                   "1:OMP_NUM_THREADS=1 (tests/fault_site/fault_injection.py's fault_env "
                   "makes one slow)")
    p.add_argument("--state-file", default=None)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    try:
        args.replica_env_of = replica_envs(args.replica_env, args.replicas)
    except ValueError as exc:
        p.error(str(exc))
    if "--block-size" not in serve_args:
        serve_args += ["--block-size", str(args.block_size)]
    return args, serve_args


def stop(procs: list[subprocess.Popen[Any]], timeout_s: float = 30.0) -> None:
    """SIGTERM to each (the replicas drain), then SIGKILL whatever is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    router_bin = find_router(args.router_bin)
    if router_bin is None:
        print("vllm-router not found: pip install vllm-router, or pass --router-bin",
              file=sys.stderr)
        return 2
    procs: list[subprocess.Popen[Any]] = []
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        replicas: list[Replica] = []
        threads = split_threads(args.threads, args.replicas)
        for i in range(args.replicas):
            env = {**os.environ, "OMP_NUM_THREADS": str(threads[i]),
                   **args.replica_env_of.get(i, {})}
            # Own session: killing a replica's group takes its engine process with it.
            proc = subprocess.Popen(replica_command(args, i, serve_args), env=env,
                                    start_new_session=True)
            procs.append(proc)
            events = f"tcp://127.0.0.1:{args.kv_events_base_port + i}" if args.kv_events else None
            replicas.append(Replica(f"http://{args.host}:{args.replica_base_port + i}",
                                    proc.pid, events))
        for r, proc in zip(replicas, procs, strict=True):
            wait_healthy(r.url, proc, args.startup_timeout, f"replica {r.url}")
        router = subprocess.Popen(router_command(args, router_bin, replicas),
                                  start_new_session=True)
        procs.insert(0, router)  # stopped first, so no request reaches a draining replica
        router_url = f"http://{args.host}:{args.port}"
        wait_healthy(router_url, router, 60.0, "vllm-router")
        state = {"router_url": router_url, "router_pid": router.pid, "policy": args.policy,
                 "threads": threads, "replicas": [asdict(r) for r in replicas]}
        if args.state_file:
            tmp = Path(args.state_file + ".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(args.state_file)
        print(json.dumps(state), flush=True)
        while not stopping and router.poll() is None:
            time.sleep(0.2)
        return 0 if stopping else 1
    except RuntimeError as exc:
        print(f"serve_replicas: {exc}", file=sys.stderr)
        return 1
    finally:
        stop(procs)


if __name__ == "__main__":
    sys.exit(main())
