"""``tailserve tune``: the latency trade-off of engine settings, measured.

Runs the grid of engine flags on live servers (analyze/sweep.py: a fresh ``tailserve serve``
per point, one ``tailserve bench`` step of the given workload -- or with ``--capacity`` the
bench's capacity search -- then stop), then finds the Pareto front over goodput (capacity at
>= 90% and >= 99% of requests meeting the SLOs; without ``--capacity`` goodput share and
output throughput) and the setting to recommend for the SLOs (analyze/tradeoff.py), prints
them and writes them as JSON and an HTML page.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tailserve.analyze.sweep import SweepOptions, parse_grid, print_sweep, run_sweep
from tailserve.analyze.tradeoff import (
    Recommendation,
    Slos,
    goodput_front,
    pareto_front,
    recommend,
)

if TYPE_CHECKING:
    from tailserve.bench.config import BenchConfig


TABLE_COLUMNS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                 "median_itl_ms", "p99_itl_ms", "goodput_share", "request_goodput",
                 "capacity_90", "capacity_99", "max_scheduled_seqs")


@dataclass
class TuneResult:
    keys: list[str]  # the swept flags, in grid order
    rows: list[dict[str, Any]]  # one per grid point: its flags and its figures (or "error")
    front: list[int]  # indices into rows: the goodput front, best first
    recommended: Recommendation | None
    slos: Slos
    workload: str

    def as_json(self) -> dict[str, Any]:
        return {"grid": self.keys, "slos_ms": asdict(self.slos), "workload": self.workload,
                "rows": self.rows, "pareto_front": self.front,
                "latency_front": pareto_front(self.rows),
                "recommended": None if self.recommended is None else asdict(self.recommended)}


def describe_workload(cfg: BenchConfig) -> str:
    d = cfg.dataset
    if d.name == "mixed":
        lengths = f"mix {d.mix}"
    else:
        spread = f" (x{1 - d.range_ratio:g}..{1 + d.range_ratio:g})" if d.range_ratio else ""
        lengths = f"input {d.input_len}{spread}, output {d.output_len or 'default'}"
    rate = "all at once" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g} req/s"
    if cfg.sweep:
        rate = "the capacity search's rates"
    cap = f", at most {cfg.max_concurrency} in flight" if cfg.max_concurrency else ""
    return f"{d.num_prompts} {d.name} prompts, {lengths}, {rate}{cap}"


def analyze_rows(rows: list[dict[str, Any]], keys: list[str], slos: Slos,
                 workload: str) -> TuneResult:
    return TuneResult(keys=keys, rows=rows, front=goodput_front(rows),
                      recommended=recommend(rows, slos), slos=slos, workload=workload)


def run_tune(model: str | None, grid: list[str], bench: BenchConfig, slos: Slos,
             serve_args: list[str] | None = None, console: Any = None) -> TuneResult:
    combos = parse_grid(grid)  # a typo fails here, before any server starts
    keys = list(combos[0]) if combos else []
    rows = run_sweep(SweepOptions(model=model, grid=grid, serve_args=serve_args or [],
                                  bench=bench, slos=slos), console)
    return analyze_rows(rows, keys, slos, describe_workload(bench))


def print_tune(t: TuneResult, console: Any) -> None:
    marks = {i: "front" for i in t.front}
    if t.recommended is not None:
        marks[t.recommended.index] = "[bold green]best[/]"
    print_sweep(t.rows, console, marks=marks, title=f"tailserve tune: {t.workload}",
                only=TABLE_COLUMNS)
    if t.recommended is None:
        console.print("[red]no setting completed a request[/]")
        return
    r = t.rows[t.recommended.index]
    flags = " ".join(f"--{k} {r[k]}" for k in t.keys)
    color = "green" if t.recommended.meets_slos else "yellow"
    console.print(f"[{color}]recommended: {flags}[/] -- {t.recommended.reason}")


def save_tune(t: TuneResult, path: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(t.as_json(), f, indent=1)
    except OSError as exc:
        raise ValueError(f"cannot write --save-result {path}: {exc}") from None
