"""``tailserve plan --sweep``: the tuning experiment, run rather than estimated.

For every combination of the swept serve flags (``block-size=8,16 max-num-seqs=64,128`` is
four), start ``tailserve serve`` on a free loopback port, wait for ``/health``, run one bench
step against it (bench/run.py, the same code as ``tailserve bench``), stop the server, and
keep one row: throughput, P50/P99 TTFT and ITL, the goodput share for the SLOs
(analyze/tradeoff.py), the KV pool and the memory the server reported. Combinations run one
after another, each on a fresh server, so none inherits another's cache or allocator state.
``tailserve tune`` runs the same loop with any bench workload and draws the trade-off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tailserve.analyze.tradeoff import Slos, goodput_share
from tailserve.config import EngineArgs
from tailserve.errors import ConfigError

if TYPE_CHECKING:
    from tailserve.bench.config import BenchConfig

HEALTH_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SweepOptions:
    model: str | None
    grid: list[str]  # ["block-size=8,16", "max-num-seqs=64,128"]
    serve_args: list[str] = field(default_factory=list)  # passed to every server
    num_prompts: int = 200
    input_len: int = 512
    output_len: int = 64
    request_rate: float = float("inf")
    seed: int = 0
    # The whole workload, as `tailserve bench` takes it (base_url is set per server); when
    # given, num_prompts .. seed above are not used.
    bench: BenchConfig | None = None
    slos: Slos = field(default_factory=Slos)


def parse_grid(grid: list[str]) -> list[dict[str, str]]:
    """``["block-size=8,16", "max-num-seqs=4"]`` -> one dict of flag -> value per combination,
    in the order given (the last flag varies fastest). Flags are EngineArgs fields."""
    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    axes: list[tuple[str, list[str]]] = []
    for item in grid:
        flag, eq, values = item.partition("=")
        key = flag.strip().lstrip("-").replace("_", "-")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or not vals:
            raise ConfigError(f"--sweep wants FLAG=V1,V2 (e.g. block-size=8,16); got {item!r}")
        if key.replace("-", "_") not in names:
            raise ConfigError(f"--sweep {key}: not a serve engine flag; one of "
                              f"{', '.join(sorted(n.replace('_', '-') for n in names))}")
        axes.append((key, vals))
    return [dict(zip([k for k, _ in axes], combo, strict=True))
            for combo in itertools.product(*(v for _, v in axes))]


def combo_flags(combo: dict[str, str]) -> list[str]:
    """Serve flags for one combination; booleans become ``--x`` / ``--no-x``."""
    hints = typing.get_type_hints(EngineArgs)
    flags: list[str] = []
    for key, value in combo.items():
        hint = hints[key.replace("-", "_")]
        if hint is bool or bool in typing.get_args(hint):  # bool or bool | None
            on = value.lower() in ("1", "true", "yes", "on")
            flags.append(f"--{key}" if on else f"--no-{key}")
        else:
            flags += [f"--{key}", value]
    return flags


def run_sweep(opts: SweepOptions, console: Any = None) -> list[dict[str, Any]]:
    """One row per combination (a failed server start is a row with its ``error``).

    A finished server drains and stops (seconds) while the next one starts, but no bench
    step begins before the previous server has exited: no step shares the host with another
    server's work."""
    combos = parse_grid(opts.grid)
    rows = []
    stopping: threading.Thread | None = None
    try:
        for i, combo in enumerate(combos):
            if console is not None:
                console.print(f"[{i + 1}/{len(combos)}] serve {' '.join(combo_flags(combo))}")
            row, stopping = _one(opts, combo, stopping)
            rows.append({**combo, **row})
    finally:
        if stopping is not None:
            stopping.join()
    return rows


def _one(opts: SweepOptions, combo: dict[str, str], previous: threading.Thread | None
         ) -> tuple[dict[str, Any], threading.Thread]:
    """Start a server for ``combo``, wait for ``previous`` to be stopped, bench, and return
    the row and the thread now stopping this server."""
    from rich.console import Console

    from tailserve.bench import BenchError
    from tailserve.bench.config import BenchConfig, DatasetOptions
    from tailserve.bench.run import run_bench

    port = _free_port()
    cmd = [sys.executable, "-m", "tailserve.cli", "serve",
           *([opts.model] if opts.model else []), "--port", str(port),
           "--log-level", "warning", *opts.serve_args, *combo_flags(combo)]
    # Closed by stop(), which runs on the stopping thread while the next server starts.
    log = tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        _stop(proc)
        log.close()

    try:
        url = f"http://127.0.0.1:{port}"
        error = _wait_healthy(proc, url)
        if previous is not None:
            previous.join()
        if error is not None:
            log.seek(0)
            return {"error": f"{error}: {log.read()[-2000:].decode(errors='replace')}"}, \
                _started(stop)
        if opts.bench is not None:
            cfg = dataclasses.replace(opts.bench, base_url=url, progress=False,
                                      save_result=None)
        else:
            cfg = BenchConfig(
                base_url=url, dataset=DatasetOptions(
                    name="random", num_prompts=opts.num_prompts, input_len=opts.input_len,
                    output_len=opts.output_len),
                request_rate=opts.request_rate, seed=opts.seed, progress=False,
                metrics_interval_s=0.5,
            )
        try:
            steps = run_bench(cfg, Console(file=io.StringIO()))
        except BenchError as exc:
            return {"error": str(exc)}, _started(stop)
        if cfg.sweep:
            return capacity_row(steps, cfg, opts.slos), _started(stop)
        return _row(steps[0], opts.slos), _started(stop)
    except BaseException:
        stop()
        raise


def _started(fn: Any) -> threading.Thread:
    t = threading.Thread(target=fn, name="sweep-stop", daemon=True)
    t.start()
    return t


def step_goodput_share(step: dict[str, Any], slos: Slos) -> float | None:
    """The goodput share of one bench step's result, from its per-request records."""
    records = step["tailserve"]["requests"]
    return goodput_share(
        [r.get("ttft_s") for r in records], [r.get("itl_s") or [] for r in records],
        [r.get("error_type") is None and r.get("send_s") is not None for r in records], slos)


def capacity_row(steps: list[dict[str, Any]], cfg: BenchConfig, slos: Slos
                 ) -> dict[str, Any]:
    """A grid point measured by the capacity search: its capacities, and the figures of the
    step at the 90% capacity (the highest rate that kept 90% good; else the first step)."""
    from tailserve.bench.capacity import capacity_summary
    from tailserve.bench.run import search_options

    cap = capacity_summary(steps, search_options(cfg))
    c90, c99 = cap["targets"][0], cap["targets"][1]
    at = next((s for s in steps if s.get("request_rate") == c90["capacity_req_s"]), steps[0])
    return {**_row(at, slos), "capacity_90": c90["capacity_req_s"],
            "capacity_99": c99["capacity_req_s"],
            "capacity_resolved": bool(c90["resolved"] and c99["resolved"]),
            "capacity_points": cap["points"]}


def _row(step: dict[str, Any], slos: Slos) -> dict[str, Any]:
    server = step["tailserve"].get("server") or {}
    samples = server.get("metric_samples") or []
    # The widest batch a step ran: the settings' effect, seen from the engine's side.
    widths = [r["num_scheduled_seqs"] for r in server.get("timeline") or []
              if r.get("kind") == "step"]

    def peak(prefix: str) -> float | None:
        vals = [v for s in samples for k, v in (s.get("values") or {}).items()
                if k.startswith(prefix)]
        return max(vals) if vals else None

    share = step_goodput_share(step, slos)
    examples = step["tailserve"].get("failures", {}).get("examples") or {}
    failure = {"failure": "; ".join(f"{k}: {v}"[:300] for k, v in examples.items())
               } if step["failed"] else {}
    return {
        **failure,
        "completed": step["completed"], "failed": step["failed"],
        "request_throughput": step["request_throughput"],
        "output_throughput": step["output_throughput"],
        "median_ttft_ms": step["median_ttft_ms"], "p99_ttft_ms": step["p99_ttft_ms"],
        "median_itl_ms": step["median_itl_ms"], "p99_itl_ms": step["p99_itl_ms"],
        "goodput_share": share,
        # Good requests per second of the step (DistServe's goodput).
        "request_goodput": None if share is None or not step["duration"] else
        share * len(step["tailserve"]["requests"]) / step["duration"],
        "max_scheduled_seqs": max(widths) if widths else None,
        "kv_cache_total_blocks": peak("tailserve:kv_cache_total_blocks"),
        "peak_kv_cache_usage_perc": peak("tailserve:kv_cache_usage_perc"),
        "num_preemptions": peak("tailserve:num_preemptions_total"),
        "peak_device_memory_bytes": peak("tailserve:device_memory_used_bytes"),
        "peak_torch_reserved_bytes": peak("tailserve:torch_memory_reserved_bytes"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(proc: subprocess.Popen[bytes], url: str) -> str | None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    return f"the server was not healthy after {HEALTH_TIMEOUT_S:.0f} s"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains and stops its engine), then SIGKILL to the whole session:
    the engine is a grandchild and must not outlive a wedged server."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def print_sweep(rows: list[dict[str, Any]], console: Any, marks: dict[int, str] | None = None,
                title: str = "plan --sweep: one bench step per combination",
                only: tuple[str, ...] | None = None) -> None:
    """The grid as a table; ``marks`` adds a first column (tune: front / recommended),
    ``only`` keeps those figure columns."""
    from rich.table import Table

    ok = [r for r in rows if "error" not in r]
    keys = [k for k in rows[0] if k not in _COLUMNS and k not in NOT_COLUMNS
            ] if rows else []
    # Memory gauges a server does not have (no device, CPU torch) would be a column of dashes.
    # Capacities exist only where the capacity search ran (tune --capacity).
    columns = {k: head for k, head in _COLUMNS.items()
               if (not k.endswith("_bytes") or any(r.get(k) for r in ok))
               and (not k.startswith("capacity_") or any(k in r for r in ok))
               and (only is None or k in only)}
    t = Table(title=title, title_justify="left")
    if marks is not None:
        t.add_column("")
    for k in keys:
        t.add_column(k, style="bold", no_wrap=True)
    for head in columns.values():
        t.add_column(head, justify="right")
    for i, r in enumerate(rows):
        if "error" in r:
            console.print(f"[red]{' '.join(f'{k}={r[k]}' for k in keys)}: {r['error']}[/]")
            continue
        mark = [] if marks is None else [marks.get(i, "")]
        t.add_row(*mark, *(str(r[k]) for k in keys), *(_fmt(k, r.get(k)) for k in columns))
    console.print(t)
    for r in rows:
        if "failure" in r:
            console.print(f"[yellow]{' '.join(f'{k}={r[k]}' for k in keys)}: {r['failed']} "
                          f"failed, e.g. {r['failure']}[/]")


# Row keys that are neither grid flags nor table columns.
NOT_COLUMNS = ("error", "failure", "capacity_resolved", "capacity_points")
_COLUMNS = {
    "completed": "ok", "failed": "fail", "request_throughput": "req/s",
    "output_throughput": "tok/s", "median_ttft_ms": "P50 TTFT ms", "p99_ttft_ms": "P99 TTFT ms",
    "median_itl_ms": "P50 ITL ms", "p99_itl_ms": "P99 ITL ms", "goodput_share": "good %",
    "request_goodput": "good req/s", "capacity_90": "cap@90% req/s",
    "capacity_99": "cap@99% req/s",
    "max_scheduled_seqs": "max batch",
    "kv_cache_total_blocks": "KV blocks", "peak_kv_cache_usage_perc": "KV peak %",
    "num_preemptions": "preempt", "peak_device_memory_bytes": "mem GiB",
    "peak_torch_reserved_bytes": "torch GiB",
}


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key.endswith("_bytes"):
        return f"{v / (1 << 30):.2f}"
    if key in ("kv_cache_total_blocks", "num_preemptions", "max_scheduled_seqs"):  # counts
        return f"{int(v):,}"
    if key == "goodput_share":
        return f"{100 * v:.1f}"
    if key == "peak_kv_cache_usage_perc":
        return f"{100 * v:.1f}" if v <= 1 else f"{v:.1f}"
    return f"{v:,.2f}" if isinstance(v, float) else f"{v:,}"
