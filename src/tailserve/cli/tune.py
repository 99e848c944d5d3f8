"""``tailserve tune``: a grid of engine settings, each served and benchmarked, judged on
goodput and capacity."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from tailserve.cli_flags import add_flags, from_namespace

TUNE_BENCH_SKIP = (
    "base_url", "model", "api_key", "request_rates", "sweep", "sweep_steps", "goodput",
    "percentiles", "save_result", "save_detailed", "label", "progress", "base_url_b", "split",
    "users", "replicas", "slo_ttft_ms", "slo_itl_ms", "slo_tpot_ms", "server_slos",
)
TUNE_DATASET_DEFAULTS = {"num_prompts": 100}
TUNE_BENCH_DEFAULTS = {"request_rate": 1.0}


def _cmd_tune(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.tradeoff import Slos
    from tailserve.analyze.tune import print_tune, run_tune, save_tune
    from tailserve.bench.config import BenchConfig, DatasetOptions

    bench = from_namespace(BenchConfig, ns, skip=TUNE_BENCH_SKIP,
                           dataset=from_namespace(DatasetOptions, ns), progress=False)
    slos = from_namespace(Slos, ns)
    # Every step judges the tune's SLOs; --capacity runs the bench's capacity search per point.
    bench = dataclasses.replace(bench, slo_ttft_ms=slos.ttft_ms, slo_itl_ms=slos.itl_ms,
                                sweep=ns.capacity)
    if ns.html:
        from tailserve.bench.result import check_writable

        check_writable(ns.html)  # before the grid runs, not after
    result = run_tune(ns.model_path, ns.grid, bench, slos, ns.serve_arg,
                      Console(stderr=True))
    if ns.save_result:
        save_tune(result, ns.save_result)
    if ns.html:
        from tailserve.analyze.tune_report import write_tune_html

        write_tune_html(ns.html, result.rows, result.keys, slos, result.recommended,
                        result.workload)
    if ns.json:
        print(json.dumps(result.as_json(), indent=1))
    else:
        print_tune(result, Console())
    return 0 if all(r.get("completed") for r in result.rows) else 1


def add_tune(sub: Any) -> None:
    from tailserve.analyze.tradeoff import Slos
    from tailserve.bench.config import BenchConfig, DatasetOptions

    t = sub.add_parser(
        "tune", help="measure the goodput and latency trade-off of engine settings",
        description="For every combination of --grid values, start `tailserve serve` on a "
        "loopback port, run one `tailserve bench` step of the workload (--capacity: the "
        "capacity search), stop it; then print each setting's P50/P99 TTFT and ITL, goodput "
        "share and good req/s (and capacities), the Pareto front over goodput (capacity at "
        "90%% and 99%%; else goodput share and output throughput), and the setting recommended "
        "for --slo-ttft-ms / --slo-itl-ms (the highest capacity, else the highest goodput "
        "share). Exit status: 0; 1 if a setting completed no request; 2 on a usage error.",
    )
    t.add_argument("model_path", nargs="?", metavar="MODEL", default=None,
                   help="HF folder or .gguf to serve (default: the bundled model)")
    t.add_argument("--grid", action="append", required=True, metavar="FLAG=V1,V2",
                   help="an engine flag and its values, repeatable: --grid "
                   "max-num-batched-tokens=256,512 --grid max-num-seqs=8,32")
    t.add_argument("--serve-arg", action="append", default=None, metavar="ARG",
                   help="extra argument for every server, e.g. --serve-arg=--kv-cache-memory=1")
    t.add_argument("--capacity", action="store_true",
                   help="per setting, search the capacity (the highest request rates with >= "
                   "90%% and >= 99%% of requests meeting the SLOs; bench --sweep's search, "
                   "bounded by --sweep-max-steps) instead of one step at --request-rate, and "
                   "choose by it")
    add_flags(t, Slos, group="SLOs")
    out = t.add_argument_group("output")
    out.add_argument("--html", default=None, metavar="FILE",
                     help="write the plots and the table as one HTML page")
    out.add_argument("--save-result", default=None, metavar="FILE",
                     help="write the rows, the front and the recommendation as JSON")
    out.add_argument("--json", action="store_true", help="print that JSON instead of tables")
    groups = {title: t.add_argument_group(f"workload: {title}")
              for title in ("dataset", "load", "target", "output")}
    add_flags(t, DatasetOptions, group="dataset", groups=groups,
              defaults=TUNE_DATASET_DEFAULTS)
    add_flags(t, BenchConfig, skip=TUNE_BENCH_SKIP, groups=groups,
              defaults=TUNE_BENCH_DEFAULTS)
    t.set_defaults(func=_cmd_tune)
