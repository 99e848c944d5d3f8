"""``tailserve diagnose``, ``compare`` and ``plan``: read a bench result (or a model) and
judge it; the SLO flags they share."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from tailserve.config import QUANTIZATIONS, EngineArgs
from tailserve.errors import check_slo_ms


def slo_flags(ns: argparse.Namespace, error: type[Exception]) -> dict[str, float]:
    """``--slo-{ttft,itl,tpot}-ms`` as {kind: ms}, the ones given; ``error`` names a value
    that is not a positive number of milliseconds (diagnose and compare read them alike)."""
    slos = {k: v for k in ("ttft", "itl", "tpot")
            if (v := getattr(ns, f"slo_{k}_ms")) is not None}
    for k, v in slos.items():
        check_slo_ms(f"--slo-{k}-ms", v, error)
    return slos


def _cmd_diagnose(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.data import DiagnoseError, load_run
    from tailserve.analyze.diagnose import diagnose, print_summary

    slos = slo_flags(ns, DiagnoseError)
    d = diagnose(load_run(ns.result, ns.timeline, ns.otlp_traces), ns.percentile,
                 slos or None)
    if ns.html:
        from tailserve.analyze.report import write_html

        write_html(d, ns.html)
    if ns.json:
        print(json.dumps(d.as_json(), indent=1))
    else:
        console = Console()
        print_summary(d, console)
        if ns.html:
            console.print(f"report written to {ns.html}")
    return 0


def add_diagnose(sub: Any) -> None:
    d = sub.add_parser(
        "diagnose", help="explain the tail latency of a bench result",
        description="Split the tail (requests above --percentile) of TTFT, TPOT, ITL and E2EL "
        "into causes (queueing, prefill_interference, own_prefill, preemption, "
        "kv_cache_pressure, engine_stall, client_or_network, grammar, and on a bench --replica "
        "result router_imbalance, slow_replica; none), with evidence and advice, "
        "and find the time windows where the P99 jumps.",
    )
    d.add_argument("result", metavar="RESULT.json", help="a tailserve bench --save-result file")
    d.add_argument("--timeline", default=None, metavar="FILE",
                   help="the server's timeline JSONL (tailserve serve --timeline), if the "
                   "result does not carry it")
    d.add_argument("--otlp-traces", default=None, metavar="FILE",
                   help="vLLM's request spans as OTLP/JSON (an OpenTelemetry collector's "
                   "file exporter, fed by vllm serve --otlp-traces-endpoint): each request's "
                   "queue, prefill and server-side TTFT, joined by request id")
    d.add_argument("--percentile", type=float, default=99.0,
                   help="the tail: samples at or above this percentile (default: 99)")
    d.add_argument("--html", default=None, metavar="FILE",
                   help="also write a self-contained HTML report")
    d.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    slo = d.add_argument_group("SLOs", "which requests missed which SLO, and why (default: the "
                               "SLOs the bench run judged, else each request's own from the "
                               "server's timing)")
    for kind, what in (("ttft", "time to first token"), ("itl", "every gap between chunks"),
                       ("tpot", "mean gap after the first token")):
        slo.add_argument(f"--slo-{kind}-ms", type=float, default=None, metavar="MS",
                         help=f"{kind.upper()} SLO: the most a request's {what} may be")
    d.set_defaults(func=_cmd_diagnose)


def _cmd_compare(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.compare import (
        CompareError,
        CompareOptions,
        compare_runs,
        load_run,
        render,
        to_json,
    )
    from tailserve.analyze.compare_goodput import compare_capacity, load_capacity

    slos = slo_flags(ns, CompareError)
    cap_a, cap_b = load_capacity(ns.a), load_capacity(ns.b)
    if cap_a is not None and cap_b is not None:
        return _compare_capacity(ns, compare_capacity(cap_a, cap_b, ns.threshold))
    opts = CompareOptions(
        metrics=tuple(m.strip() for m in ns.metric.split(",") if m.strip()),
        percentile=ns.percentile, confidence=ns.confidence, threshold_pct=ns.threshold,
        num_resamples=ns.resamples, seed=ns.seed, slos_ms=slos or None,
    )
    a = [load_run(p) for p in [ns.a, *(ns.replicate_a or [])]]
    b = [load_run(p) for p in [ns.b, *(ns.replicate_b or [])]]
    c = compare_runs(a, b, opts)
    if ns.json:
        print(json.dumps(to_json(c), indent=1))
    else:
        render(c, Console())
    return 0 if c.passed else 1


def _compare_capacity(ns: argparse.Namespace, caps: list[Any]) -> int:
    """Two ``bench --sweep`` summaries: their capacities, gated (analyze/compare_goodput.py)."""
    from rich.console import Console

    from tailserve.analyze.compare_goodput import render_slo_gates

    passed = not any(c.gate_failed for c in caps)
    if ns.json:
        print(json.dumps({"a": ns.a, "b": ns.b, "threshold_pct": ns.threshold,
                          "capacity": [c.as_json() for c in caps], "passed": passed},
                         indent=1))
    else:
        console = Console()
        render_slo_gates(None, caps, ns.confidence, console)
        console.print("[bold green]PASS[/]" if passed else
                      "[bold red]FAIL[/]: B missed a capacity target at a rate A met")
    return 0 if passed else 1


def add_compare(sub: Any) -> None:
    c = sub.add_parser(
        "compare", help="A/B: is B's latency significantly worse than A's?",
        description="For TTFT, TPOT, ITL and E2EL: P50 and the tail percentile of A and B, "
        "B − A with a bootstrap confidence interval (requests resampled within a run, or whole "
        "runs when both sides have replicates), a Mann-Whitney p-value and a verdict; with "
        "SLOs the goodput share as well; two `bench --sweep` summaries by their capacity. Exit "
        "status: 0 when B is not significantly worse than A beyond --threshold, 1 when it is, "
        "2 on a usage error.",
    )
    c.add_argument("a", metavar="A.json", help="baseline: a tailserve bench --save-result file")
    c.add_argument("b", metavar="B.json", help="candidate result file")
    c.add_argument("--replicate-a", action="extend", nargs="+", metavar="FILE",
                   help="more runs of A (with 2+ runs on both sides whole runs are resampled)")
    c.add_argument("--replicate-b", action="extend", nargs="+", metavar="FILE",
                   help="more runs of B")
    c.add_argument("--metric", default="ttft,tpot,itl,e2el", help="(default: %(default)s)")
    c.add_argument("--percentile", type=float, default=99.0,
                   help="the tail percentile judged (default: 99)")
    c.add_argument("--confidence", type=float, default=0.95, help="(default: 0.95)")
    c.add_argument("--threshold", type=float, default=0.0, metavar="PCT",
                   help="fail only when B's tail is worse by more than PCT percent, with the "
                   "chosen confidence (default: 0)")
    c.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default: "
                   "2000)")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    slo = c.add_argument_group(
        "SLOs", "gate the goodput share too (default: the SLOs A's bench run judged, else each "
        "request's own from the server's timing); two `bench --sweep` summaries are compared "
        "by their capacity instead")
    for kind, what in (("ttft", "time to first token"), ("itl", "every gap between chunks"),
                       ("tpot", "mean gap after the first token")):
        slo.add_argument(f"--slo-{kind}-ms", type=float, default=None, metavar="MS",
                         help=f"{kind.upper()} SLO: the most a request's {what} may be")
    c.set_defaults(func=_cmd_compare)


def _cmd_plan(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.plan import PlanInputs, load_config, make_plan, render_plan

    inputs = PlanInputs(
        model=ns.model, device_memory_gib=ns.device_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization, max_model_len=ns.max_model_len,
        context=ns.context, dtype=ns.dtype, quantization=ns.quantization,
        quantization_group_size=ns.quantization_group_size, kv_dtype=ns.kv_dtype,
        block_size=ns.block_size,
        tensor_parallel_size=ns.tensor_parallel_size,
        memory_bandwidth_gbs=ns.memory_bandwidth, batch=ns.batch,
    )
    if ns.sweep:
        from tailserve.analyze.sweep import SweepOptions, print_sweep, run_sweep

        rows = run_sweep(SweepOptions(
            model=ns.model, grid=ns.sweep, serve_args=ns.serve_arg or [],
            num_prompts=ns.sweep_num_prompts, input_len=ns.sweep_input_len,
            output_len=ns.sweep_output_len, request_rate=ns.sweep_request_rate),
            Console(stderr=True))
        if ns.json:
            print(json.dumps(rows, indent=1))
        else:
            print_sweep(rows, Console())
        return 0 if all(r.get("completed") for r in rows) else 1
    cfg, path, file_bytes = load_config(ns.model)
    plan = make_plan(cfg, inputs, path, file_bytes)
    if ns.json:
        print(json.dumps(plan.as_json(), indent=1))
    else:
        render_plan(plan, Console())
    return 0


def add_plan(sub: Any) -> None:
    from tailserve.analyze.plan import KV_DTYPES, WEIGHT_DTYPES

    p = sub.add_parser(
        "plan", help="size the KV cache and the decode roofline from a model's config",
        description="From the model's config alone (no weights loaded): weight bytes, KV bytes "
        "per token (GQA counted), the KV blocks that fit, max concurrent sequences, and the "
        "decode roofline for 16-bit, int8 and int4 weights. --sweep instead launches a server "
        "per combination of engine flags and benchmarks each.",
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model folder, config.json or .gguf (default: the bundled model)")
    p.add_argument("--device-memory", type=float, default=None, metavar="GiB",
                   help="memory per device (default: 80)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=EngineArgs.gpu_memory_utilization,
                   help="fraction for weights + KV (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence for concurrency and KV reads (default: "
                   "--max-model-len)")
    p.add_argument("--dtype", choices=("auto", *WEIGHT_DTYPES), default="auto",
                   help="weights as served (auto: a GGUF's blocks as stored, else bfloat16; "
                   "int8 / int4: as --quantization)")
    quant = {f.name: f for f in dataclasses.fields(EngineArgs)}
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help=quant["quantization"].metadata["help"])
    p.add_argument("--quantization-group-size", type=int,
                   default=quant["quantization_group_size"].default,
                   help=quant["quantization_group_size"].metadata["help"])
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", choices=KV_DTYPES,
                   default="auto", help="KV cache, as serve's --kv-cache-dtype (auto: --dtype, "
                   "16-bit for integer weights)")
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    p.add_argument("--tensor-parallel-size", type=int, default=EngineArgs.tensor_parallel_size)
    p.add_argument("--memory-bandwidth", type=float, default=None, metavar="GB/s",
                   help="per device (default: 3350, H100 SXM)")
    p.add_argument("--batch", type=int, default=64,
                   help="decode batch for the aggregate roofline (default: 64)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep", nargs="+", default=None, metavar="FLAG=V1,V2",
                   help="serve flags to sweep, e.g. block-size=8,16,32 max-num-seqs=64,128")
    s.add_argument("--serve-arg", action="append", default=None, metavar="ARG",
                   help="extra argument for every server, e.g. --serve-arg=--kv-cache-memory=1")
    s.add_argument("--sweep-num-prompts", type=int, default=200)
    s.add_argument("--sweep-input-len", type=int, default=512)
    s.add_argument("--sweep-output-len", type=int, default=64)
    s.add_argument("--sweep-request-rate", type=float, default=float("inf"),
                   help="requests/s of the bench step (default: inf, all at once)")
    p.set_defaults(func=_cmd_plan)


# tune: bench flags that make no sense for servers it starts itself, and the workload it
# runs where bench's own defaults (1,000 prompts all at once) measure saturation, not a trade-off.
