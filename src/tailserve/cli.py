"""The ``tailserve`` command: ``serve``, ``generate``, ``bench``, ``diagnose``, ``compare`` and
``plan``. Engine flags are generated from ``EngineArgs`` fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

from tailserve.config import EngineArgs


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineArgs field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        tp = _unwrap_optional(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        default = f.default
        if tp is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif get_origin(tp) is Literal:
            group.add_argument(flag, choices=get_args(tp), default=default, help=help_text)
        else:
            group.add_argument(flag, type=tp, default=default,
                               help=f"{help_text} (default: {default})".strip())


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


def _cmd_generate(ns: argparse.Namespace) -> int:
    from tailserve.engine.llm import LLM
    from tailserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        min_p=ns.min_p, seed=ns.sample_seed, stop=ns.stop or [], n=ns.n,
        ignore_eos=ns.ignore_eos, repetition_penalty=ns.repetition_penalty,
    )
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


def _cmd_serve(ns: argparse.Namespace) -> int:
    import os

    from tailserve.server.app import run_server
    from tailserve.server.context import ServerSettings

    if ns.model_pos is not None:
        ns.model = ns.model_pos
    settings = ServerSettings(
        host=ns.host, port=ns.port,
        api_key=ns.api_key or os.environ.get("TAILSERVE_API_KEY") or None,
        served_model_name=ns.served_model_name, max_request_bytes=ns.max_request_bytes,
        max_header_bytes=ns.max_header_bytes, shutdown_timeout=ns.shutdown_timeout,
        timeline=ns.timeline, timeline_buffer=ns.timeline_buffer,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        watchdog_timeout=ns.watchdog_timeout, log_level=ns.log_level,
        enable_profiling=ns.enable_profiling, profile_dir=ns.profile_dir,
    )
    return run_server(engine_args_from(ns), settings)


def _add_serve(sub: Any) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                     help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    srv.add_argument("--model", default=None, help=argparse.SUPPRESS)
    g = srv.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set TAILSERVE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="the name clients use as model")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="larger bodies get 413 (default: 4 MiB)")
    g.add_argument("--max-header-bytes", type=int, default=16 << 10,
                   help="larger headers get 431 (default: 16 KiB)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    g.add_argument("--timeline", default=None, help="append step and request records (JSONL)")
    g.add_argument("--timeline-buffer", type=int, default=20000,
                   help="records kept in memory for GET /debug/timeline")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces")
    g.add_argument("--watchdog-timeout", type=float, default=30.0,
                   help="/health turns 503 after this long without engine progress")
    g.add_argument("--enable-profiling", action="store_true",
                   help="allow POST /debug/profile?seconds=N (torch.profiler trace of the engine)")
    g.add_argument("--profile-dir", default=None,
                   help="where profile traces go (default: <tmp>/tailserve-profiles)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)


def _cmd_bench(ns: argparse.Namespace) -> int:
    import os

    from tailserve.bench.datasets import DatasetOptions
    from tailserve.bench.metrics import parse_goodput, parse_percentiles
    from tailserve.bench.run import BenchConfig, run_bench

    def rates(spec: str) -> list[float]:
        try:
            return [float(r) for r in spec.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--request-rates wants numbers like 1,2,4,8; got {spec!r}") from None

    extra = None
    if ns.extra_body:
        try:
            extra = json.loads(ns.extra_body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    cfg = BenchConfig(
        base_url=ns.base_url, model=ns.model, endpoint=ns.endpoint,
        api_key=ns.api_key or os.environ.get("OPENAI_API_KEY")
        or os.environ.get("TAILSERVE_API_KEY") or None,
        dataset=DatasetOptions(
            name=ns.dataset, path=ns.dataset_path, num_prompts=ns.num_prompts,
            input_len=ns.input_len, output_len=ns.output_len, range_ratio=ns.range_ratio,
            mix=ns.mix, prefix_len=ns.prefix_len, num_prefixes=ns.num_prefixes,
        ),
        request_rate=ns.request_rate,
        request_rates=rates(ns.request_rates) if ns.request_rates else None,
        sweep=ns.sweep, sweep_steps=ns.sweep_steps, burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency, goodput=parse_goodput(ns.goodput),
        percentiles=parse_percentiles(ns.percentiles), warmup=ns.warmup, seed=ns.seed,
        save_result=ns.save_result, save_detailed=ns.save_detailed, label=ns.label,
        timeout_s=ns.timeout if ns.timeout and ns.timeout > 0 else None,
        tokenizer=ns.tokenizer, ignore_eos=ns.ignore_eos, extra_body=extra,
        progress=not ns.no_progress, observe=not ns.no_observe,
        metrics_interval_s=ns.metrics_interval, argv=sys.argv,
        base_url_b=ns.base_url_b, split=ns.split, users=ns.users,
        http_client=ns.http_client, busy_poll=ns.busy_poll,
    )
    try:
        steps = run_bench(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step started
        print("interrupted", file=sys.stderr)
        return 130
    if any(s["tailserve"]["interrupted"] for s in steps):
        return 130
    return 0 if all(s["completed"] > 0 for s in steps) else 1


def _add_bench(sub: Any) -> None:
    from tailserve.bench import DATASETS, DEFAULT_INPUT_LEN, DEFAULT_MIX

    b = sub.add_parser(
        "bench", help="open-loop load test of any OpenAI-compatible server",
        description="Send a precomputed open-loop load and report TTFT, TPOT, ITL, E2EL, "
        "throughput and goodput (vLLM's definitions), with the server's own view when it is "
        "tailserve. Ctrl-C stops sending and still reports what was sent. Exit status: 0; 1 if "
        "a step completed no request; 2 on a usage error; 130 when interrupted.",
    )
    t = b.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, with or without /v1 (default: %(default)s)")
    t.add_argument("--base-url-b", default=None,
                   help="canary split: a second server; --split of the users go to it and one "
                   "result per arm is saved (PATH-A.json, PATH-B.json) for tailserve compare")
    t.add_argument("--split", type=float, default=0.1,
                   help="share of users sent to --base-url-b (default: %(default)s)")
    t.add_argument("--users", type=int, default=100,
                   help="synthetic users, each sticking to one arm by the FNV-1a hash of its "
                   "id (default: %(default)s)")
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    t.add_argument("--model", default=None, help="model name (default: the server's first)")
    t.add_argument("--api-key", default=None,
                   help="Bearer key (default: $OPENAI_API_KEY or $TAILSERVE_API_KEY)")
    t.add_argument("--http-client", choices=["lean", "aiohttp"], default="lean",
                   help="lean: a minimal HTTP/1.1 client for http:// (lowest client-added "
                   "latency); aiohttp: always aiohttp. https:// always uses aiohttp "
                   "(default: %(default)s)")
    t.add_argument("--busy-poll", action="store_true",
                   help="spin instead of sleeping from 2 ms before each send and while 1-4 "
                   "requests are in flight, so the OS's wake-up latency stays out of TTFT; "
                   "for low-rate latency runs on a host where the client has a core to "
                   "itself (costs up to one core while requests are in flight)")
    t.add_argument("--timeout", type=float, default=600.0,
                   help="per-request limit in seconds; 0 for none (default: %(default)s)")
    t.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="ask for exactly max_tokens (default: on for random/mixed/prefix)")
    d = b.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument("--dataset-path", default=None, help="file for sharegpt / jsonl")
    d.add_argument("--num-prompts", type=int, default=1000, help="requests per step")
    d.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN,
                   help="prompt tokens (random, prefix: the part after the prefix)")
    d.add_argument("--output-len", type=int, default=None,
                   help="max_tokens (default: 128; sharegpt: the reply's length)")
    d.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in L·[1-X, 1+X] (default: 0)")
    d.add_argument("--mix", default=DEFAULT_MIX,
                   help="mixed: LEN:WEIGHT or IN/OUT:WEIGHT items (default: %(default)s)")
    d.add_argument("--prefix-len", type=int, default=256, help="prefix: shared tokens")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct prefixes")
    d.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf for lengths, or 'default' for the bundled model "
                   "(default: the server's /tokenize, else 4 chars/token)")
    d.add_argument("--seed", type=int, default=0)
    ld = b.add_argument_group("load")
    ld.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s, or inf to send all at once (default: inf)")
    ld.add_argument("--request-rates", default=None,
                    help="stepped load: one step per rate, e.g. 1,2,4,8")
    ld.add_argument("--sweep", action="store_true",
                    help="synchronous and throughput steps, then rates in between")
    ld.add_argument("--sweep-steps", type=int, default=4,
                    help="interpolated rates in a sweep (default: 4)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier")
    ld.add_argument("--max-concurrency", type=int, default=None,
                    help="cap on requests in flight")
    ld.add_argument("--warmup", type=int, default=0, help="unmeasured requests first")
    o = b.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    o.add_argument("--percentiles", default="50,90,99,99.9", help="(default: %(default)s)")
    o.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON")
    o.add_argument("--save-detailed", action="store_true",
                   help="also per-request lists (vLLM's input_lens, ttfts, itls, texts)")
    o.add_argument("--label", default=None, help="a name stored in the result")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    o.add_argument("--no-observe", action="store_true",
                   help="do not sample /metrics or collect /debug/timeline")
    o.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between /metrics samples (default: %(default)s)")
    b.set_defaults(func=_cmd_bench)


def _cmd_diagnose(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.data import load_run
    from tailserve.analyze.diagnose import diagnose, print_summary

    d = diagnose(load_run(ns.result, ns.timeline), ns.percentile)
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
        "kv_cache_pressure, engine_stall, client_or_network, none), with evidence and advice, "
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
    d.set_defaults(func=_cmd_diagnose)


def _cmd_compare(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.compare import CompareOptions, compare_runs, load_run, render, to_json

    opts = CompareOptions(
        metrics=tuple(m.strip() for m in ns.metric.split(",") if m.strip()),
        percentile=ns.percentile, confidence=ns.confidence, threshold_pct=ns.threshold,
        num_resamples=ns.resamples, seed=ns.seed,
    )
    a = [load_run(p) for p in [ns.a, *(ns.replicate_a or [])]]
    b = [load_run(p) for p in [ns.b, *(ns.replicate_b or [])]]
    c = compare_runs(a, b, opts)
    if ns.json:
        print(json.dumps(to_json(c), indent=1))
    else:
        render(c, Console())
    return 0 if c.passed else 1


def _add_compare(sub: Any) -> None:
    c = sub.add_parser(
        "compare", help="A/B: is B's latency significantly worse than A's?",
        description="For TTFT, TPOT, ITL and E2EL: P50 and the tail percentile of A and B, "
        "B − A with a bootstrap confidence interval (requests resampled within a run, or whole "
        "runs when both sides have replicates), a Mann-Whitney p-value and a verdict. Exit "
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
    c.set_defaults(func=_cmd_compare)


def _cmd_plan(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from tailserve.analyze.plan import PlanInputs, load_config, make_plan, render_plan

    inputs = PlanInputs(
        model=ns.model, device_memory_gib=ns.device_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization, max_model_len=ns.max_model_len,
        context=ns.context, dtype="bfloat16" if ns.dtype == "auto" else ns.dtype,
        kv_dtype=ns.kv_dtype, block_size=ns.block_size,
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
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction for weights + KV (default: 0.9)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence for concurrency and KV reads (default: "
                   "--max-model-len)")
    p.add_argument("--dtype", choices=("auto", *WEIGHT_DTYPES), default="auto",
                   help="weights as served (auto: bfloat16)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="KV cache (auto: --dtype, 16-bit for integer weights)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailserve",
        description="LLM inference with steady tail latency under mixed traffic.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="complete one prompt with the offline engine")
    gen.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print completions and timing as JSON")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    _add_serve(sub)
    _add_bench(sub)
    _add_diagnose(sub)
    _add_compare(sub)
    _add_plan(sub)
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
