"""A step's result: vLLM's top-level keys, so existing scripts read it, plus a ``tailserve``
block with what vLLM's file lacks (per-request records, failures, lengths sent, send lag,
the server's samples and timeline, the environment). docs/tools.md ("Result file") lists the keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from tailserve.bench import BenchError
from tailserve.bench.client import BACKEND_NAMES, RequestResult
from tailserve.bench.datasets import Dataset, DatasetOptions
from tailserve.bench.goodput import SloSpec, resolve_slos
from tailserve.bench.metrics import client_summary, compute_metrics, step_goodput
from tailserve.bench.preflight import ServerInfo
from tailserve.bench.report import write_svg_plot
from tailserve.bench.tokens import TokenCounter
from tailserve.bench.validity import answers

if TYPE_CHECKING:
    from tailserve.bench.config import BenchConfig

INF = float("inf")


@dataclass
class StepData:
    """Everything one step produced, before it is turned into numbers."""

    index: int
    name: str
    rate: float
    max_concurrency: int | None
    dataset: Dataset
    dataset_options: DatasetOptions
    ignore_eos: bool
    results: list[RequestResult]
    duration_s: float
    start_time: float  # time.time() at the step's start
    start_perf_counter: float  # time.perf_counter() at the same instant
    server: dict[str, Any] | None  # the observer's samples and timeline; None: not observed
    warnings: list[str]
    interrupted: bool
    run_id: str
    environment: dict[str, Any]


def build_result(cfg: BenchConfig, info: ServerInfo, counter: TokenCounter,
                 step: StepData, slos: SloSpec | None = None) -> dict[str, Any]:
    """``slos``: what the step's goodput judges (run.py resolves it once: the client's flags,
    else the server's published SLOs); None: ``cfg``'s own flags alone."""
    results = step.results
    if slos is None:
        slos = resolve_slos(cfg.slo_ttft_ms, cfg.slo_itl_ms, cfg.slo_tpot_ms, cfg.goodput)
    metrics = compute_metrics(results, step.duration_s, cfg.percentiles, slos or None)
    summary = client_summary(results, cfg.percentiles)
    warnings = list(step.warnings)
    lag99 = summary["send_lag_ms"].get("p99", 0.0)
    # Only an uncapped run promises its arrival times (with a cap, waiting for a slot is the
    # point); a tenth of the mean gap, at least 5 ms, is where the process visibly bends.
    if step.max_concurrency is None and step.rate != INF and lag99 > max(
            5.0, 100.0 / step.rate):
        warnings.append(f"the client fell behind the schedule: P99 send lag {lag99:.1f} ms; "
                        "the arrivals were not the process asked for")
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": BACKEND_NAMES[cfg.endpoint],
        "label": cfg.label,
        "model_id": info.model,
        "tokenizer_id": counter.source,
        "num_prompts": len(results),
        "request_rate": "inf" if step.rate == INF else step.rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": step.max_concurrency,
        **metrics,
    }
    if cfg.save_detailed:
        result |= {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens or 0 for r in results],
            "ttfts": [r.ttft_s or 0.0 for r in results],
            "itls": [r.itl_s for r in results],
            "generated_texts": [r.text for r in results],
            "errors": [r.error or "" for r in results],
        }
    ds = step.dataset
    ts: dict[str, Any] = {
        "step": {"index": step.index, "name": step.name, "run_id": step.run_id},
        "interrupted": step.interrupted,
        "base_url": info.base_url,
        "endpoint": cfg.endpoint,
        "goodput_slos_ms": cfg.goodput,
        # The SLOs judged and the step's goodput against them (None: no SLO given/published).
        "goodput": step_goodput(results, slos, step.duration_s).as_json() if slos else None,
        "percentiles": cfg.percentiles,
        "dataset": {"name": ds.name, "path": step.dataset_options.path,
                    "skipped": ds.skipped, "filtered": ds.filtered,
                    "seed": step.dataset_options.seed, "ignore_eos": step.ignore_eos,
                    "options": dataclasses.asdict(step.dataset_options)},
        "tokenizer": {"source": counter.source, "exact": counter.exact},
        # Request times are seconds after start_time (wall clock, the timeline's clock);
        # start_perf_counter is the same instant on time.perf_counter(), CLOCK_MONOTONIC on
        # Linux, which other processes on this host can compare with directly.
        "start_time": step.start_time,
        "start_perf_counter": step.start_perf_counter,
        **summary,
        # Structured and tool-call answers checked against their schemas (validity.py);
        # None when no request asked for structure.
        "answers": answers(ds.requests, results),
        "warnings": warnings,
        "requests": [r.as_record(cfg.save_detailed) for r in results],
        "environment": step.environment,
    }
    if step.server is not None:
        ts["server"] = {"metric_names": info.metrics_names, **step.server}
    result["tailserve"] = ts
    return result


def environment(argv: list[str], info: ServerInfo, loop_name: str,
                load_before: tuple[float, float, float],
                http_client: str = "aiohttp", busy_poll: bool = False) -> dict[str, Any]:
    import tailserve

    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "tailserve": tailserve.__version__, "aiohttp": aiohttp.__version__,
        "numpy": np.__version__, "event_loop": loop_name,
        "http_client": http_client, "busy_poll": busy_poll,
        "cpu_count": os.cpu_count(), "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()), "argv": argv,
        "server": {"version": info.version, "models": info.served_models,
                   "owned_by": info.owned_by,
                   "max_model_len": info.max_model_len, "tokenize": info.has_tokenize,
                   "timeline": info.has_timeline},
    }


def save_results(path: str, label: str | None, steps: list[dict[str, Any]],
                 console: Any, extra: dict[str, Any] | None = None) -> None:
    """One step: PATH is its result. Several: each step in PATH's stem + ``-stepN``, and PATH
    holds the summary (each step's scalar keys, its goodput share and its file; ``extra``,
    e.g. the sweep's capacity) and the plot beside it."""
    if len(steps) == 1:
        _write_json(path, steps[0])
        console.print(f"result saved to {path}")
        return
    stem, ext = os.path.splitext(path)
    rows = []
    for i, step in enumerate(steps):
        step_path = f"{stem}-step{i}{ext or '.json'}"
        _write_json(step_path, step)
        good = step["tailserve"].get("goodput") or {}
        rows.append({k: v for k, v in step.items() if not isinstance(v, (dict, list))}
                    | {"step": step["tailserve"]["step"]["name"], "result_file": step_path,
                       "goodput_share": good.get("goodput_share")})
    plot = f"{stem}-latency.svg"
    write_svg_plot(plot, steps)
    _write_json(path, {"date": steps[0]["date"], "model_id": steps[0]["model_id"],
                       "label": label, "steps": rows, "plot": plot, **(extra or {})})
    console.print(f"{len(steps)} step results saved next to {path} (summary), plot {plot}")


def check_writable(path: str) -> None:
    """Before the run, not after it: a typo in the folder must not cost the whole run."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise BenchError(f"--save-result {path}: the folder {folder} does not exist or is "
                         "not writable")


def _write_json(path: str, obj: Any) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
    except OSError as exc:
        raise BenchError(f"cannot write --save-result {path}: {exc}") from None
