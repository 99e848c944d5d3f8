"""``tailserve generate`` and ``tailserve serve``: the engine's flags (``EngineArgs``), the
server's (``ServerSettings``) and generate's sampling flags (``SamplingParams``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from tailserve import envs
from tailserve.cli_flags import add_flags, from_namespace
from tailserve.config import REMOVED_ENGINE_ARGS, EngineArgs, check_removed_args

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


def add_generate(sub: Any) -> None:
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


def add_serve(sub: Any) -> None:
    from tailserve.server.settings import ServerSettings

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                     help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    srv.add_argument("--model", default=None, help=argparse.SUPPRESS)
    add_flags(srv, ServerSettings, group="server")
    add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)
