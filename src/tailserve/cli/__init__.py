"""The ``tailserve`` command: ``serve``, ``generate``, ``bench``, ``diagnose``, ``compare``,
``plan``, ``tune`` and ``watch``. The flags of ``serve``, ``generate``, ``bench`` and ``tune``
are generated from the fields of ``EngineArgs``, ``ServerSettings``, ``SamplingParams``,
``BenchConfig`` and ``Slos`` (cli_flags.py). One module per group of commands: ``serve.py``
(generate, serve), ``bench.py``, ``analyze.py`` (diagnose, compare, plan), ``tune.py``,
``watch.py``."""

from __future__ import annotations

import argparse
import logging
import sys

from tailserve.cli.analyze import add_compare, add_diagnose, add_plan
from tailserve.cli.bench import add_bench, bench_config_from
from tailserve.cli.serve import (
    GENERATE_SAMPLING_DEFAULTS,
    GENERATE_SAMPLING_FIELDS,
    add_engine_args,
    add_generate,
    add_serve,
    engine_args_from,
    sampling_params_from,
    server_settings_from,
)
from tailserve.cli.tune import add_tune
from tailserve.cli.watch import add_watch

# What callers import from the command's package (tests, the sweep's subprocess command).
__all__ = [
    "GENERATE_SAMPLING_DEFAULTS", "GENERATE_SAMPLING_FIELDS", "add_engine_args",
    "bench_config_from", "build_parser", "engine_args_from", "main", "sampling_params_from",
    "server_settings_from",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailserve",
        description="LLM inference with steady tail latency under mixed traffic.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_generate(sub)
    add_serve(sub)
    add_bench(sub)
    add_diagnose(sub)
    add_compare(sub)
    add_plan(sub)
    add_tune(sub)
    add_watch(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.func(ns))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

