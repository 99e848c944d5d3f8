"""``tailserve bench``: its flags from ``BenchConfig`` and the dataset options."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tailserve import envs
from tailserve.cli_flags import add_flags, from_namespace


def bench_config_from(ns: argparse.Namespace, argv: list[str] | None = None) -> Any:
    from tailserve.bench.config import BenchConfig, DatasetOptions

    cfg = from_namespace(BenchConfig, ns, dataset=from_namespace(DatasetOptions, ns),
                         argv=list(argv if argv is not None else sys.argv))
    if not cfg.api_key:
        key = envs.OPENAI_API_KEY.get() or envs.TAILSERVE_API_KEY.get()
        cfg = dataclasses.replace(cfg, api_key=key)
    return cfg


def _cmd_bench(ns: argparse.Namespace) -> int:
    from tailserve.bench.run import run_bench

    cfg = bench_config_from(ns)
    try:
        steps = run_bench(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step started
        print("interrupted", file=sys.stderr)
        return 130
    if any(s["tailserve"]["interrupted"] for s in steps):
        return 130
    return 0 if all(s["completed"] > 0 for s in steps) else 1


def add_bench(sub: Any) -> None:
    from tailserve.bench.config import BenchConfig, DatasetOptions

    b = sub.add_parser(
        "bench", help="open-loop load test of any OpenAI-compatible server",
        description="Send a precomputed open-loop load and report TTFT, TPOT, ITL, E2EL, "
        "throughput (vLLM's definitions) and, with SLOs given or published by the server, "
        "goodput (the share and req/s of requests meeting every SLO; --sweep then finds the "
        "capacity: docs/goodput.md), with the server's own view when it is tailserve. Ctrl-C "
        "stops sending and still reports what was sent. Exit status: 0; 1 if a step "
        "completed no request; 2 on a usage error; 130 when interrupted.",
    )
    groups = {title: b.add_argument_group(title) for title in ("target", "dataset", "load",
                                                               "SLOs", "output")}
    add_flags(b, DatasetOptions, group="dataset", groups=groups)
    add_flags(b, BenchConfig, groups=groups)
    b.set_defaults(func=_cmd_bench)
