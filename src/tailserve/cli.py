"""The ``tailserve`` command: ``generate`` now; ``serve``, ``bench``, ``diagnose``, ``compare``
and ``plan`` join as they land. Engine flags are generated from ``EngineArgs`` fields."""

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
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)


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
