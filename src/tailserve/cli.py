"""The ``tailserve`` command: ``serve``, ``generate``, ``bench``, ``diagnose``, ``compare``,
``plan`` and ``tune``. The flags of ``serve``, ``generate``, ``bench`` and ``tune`` are
generated from the fields of ``EngineArgs``, ``ServerSettings``, ``SamplingParams``,
``BenchConfig`` and ``Slos`` (cli_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from tailserve import envs
from tailserve.cli_flags import add_flags, from_namespace
from tailserve.config import QUANTIZATIONS, REMOVED_ENGINE_ARGS, EngineArgs, check_removed_args

# generate: the SamplingParams fields it has flags for, and where its defaults differ from
# SamplingParams' own (one prompt from a terminal: greedy, with room for a paragraph).
GENERATE_SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
    "stop", "n", "ignore_eos",
)
GENERATE_SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}
# Its own --seed is the engine's; the per-request one is --sample-seed.
GENERATE_SAMPLING_RENAME = {"seed": "sample_seed"}
GENERATE_SAMPLING_HELP = {"seed": "per-request sampling seed", "stop": "stop string (repeatable)"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineArgs field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    add_flags(parser, EngineArgs, skip=("model",), group="engine")
    # Removed flags are still recognized, so their error names what replaced them.
    for name in REMOVED_ENGINE_ARGS:
        flag = "--" + name.replace("_", "-")
        names = [flag] + (["--no-" + flag[2:]] if name.startswith("enable_") else [])
        parser.add_argument(*names, dest=f"removed__{name}", nargs="?", const=True,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    check_removed_args(k.removeprefix("removed__") for k in vars(ns) if k.startswith("removed__"))
    return from_namespace(EngineArgs, ns)


def _sampling_skip() -> tuple[str, ...]:
    from tailserve.sampling_params import SamplingParams

    return tuple(f.name for f in dataclasses.fields(SamplingParams)
                 if f.name not in GENERATE_SAMPLING_FIELDS)


def sampling_params_from(ns: argparse.Namespace) -> Any:
    from tailserve.sampling_params import SamplingParams

    return from_namespace(SamplingParams, ns, skip=_sampling_skip(),
                          rename=GENERATE_SAMPLING_RENAME)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from tailserve.engine.llm import LLM

    params = sampling_params_from(ns)
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if ns.chat:
        outputs = llm.chat([{"role": "user", "content": ns.prompt}], params)
    else:
        outputs = llm.generate(ns.prompt, params)
    out = outputs[0]
    if ns.json:
        print(json.dumps({
            "prompt": out.prompt,
            "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in out.outputs
            ],
            "tailserve_timing": out.timing,
        }, indent=2))
    else:
        for c in out.outputs:
            print(c.text)
    return 0


def _add_generate(sub: Any) -> None:
    from tailserve.sampling_params import SamplingParams

    gen = sub.add_parser("generate", help="complete one prompt with the offline engine")
    gen.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print completions and timing as JSON")
    add_flags(gen, SamplingParams, skip=_sampling_skip(), defaults=GENERATE_SAMPLING_DEFAULTS,
              rename=GENERATE_SAMPLING_RENAME, help=GENERATE_SAMPLING_HELP, group="sampling")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)


def server_settings_from(ns: argparse.Namespace) -> Any:
    from tailserve.server.settings import ServerSettings

    settings = from_namespace(ServerSettings, ns)
    if not settings.api_key:
        settings = dataclasses.replace(settings, api_key=envs.TAILSERVE_API_KEY.get())
    return settings


def _cmd_serve(ns: argparse.Namespace) -> int:
    from tailserve.server.app import run_server

    if ns.model_pos is not None:
        ns.model = ns.model_pos
    return run_server(engine_args_from(ns), server_settings_from(ns))


def _add_serve(sub: Any) -> None:
    from tailserve.server.settings import ServerSettings

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                     help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    srv.add_argument("--model", default=None, help=argparse.SUPPRESS)
    add_flags(srv, ServerSettings, group="server")
    add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)


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


def _add_bench(sub: Any) -> None:
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


def _slo_flags(ns: argparse.Namespace, error: type[Exception]) -> dict[str, float]:
    """``--slo-{ttft,itl,tpot}-ms`` as {kind: ms}, the ones given; ``error`` names a value
    that is not a positive number of milliseconds (diagnose and compare read them alike)."""
    slos = {k: v for k in ("ttft", "itl", "tpot")
            if (v := getattr(ns, f"slo_{k}_ms")) is not None}
    for k, v in slos.items():
        if not 0 < v < float("inf"):
            raise error(f"--slo-{k}-ms must be a positive number of milliseconds, got {v:g}")
    return slos


def _cmd_diagnose(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.data import DiagnoseError, load_run
    from tailserve.analyze.diagnose import diagnose, print_summary

    slos = _slo_flags(ns, DiagnoseError)
    d = diagnose(load_run(ns.result, ns.timeline), ns.percentile, slos or None)
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


def _add_diagnose(sub: Any) -> None:
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

    slos = _slo_flags(ns, CompareError)
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


def _add_compare(sub: Any) -> None:
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


def _add_plan(sub: Any) -> None:
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


def _add_tune(sub: Any) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailserve",
        description="LLM inference with steady tail latency under mixed traffic.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_diagnose(sub)
    _add_compare(sub)
    _add_plan(sub)
    _add_tune(sub)
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


if __name__ == "__main__":
    sys.exit(main())
