"""What one ``tailserve bench`` run is asked to do: ``BenchConfig`` and its ``DatasetOptions``.

The command's flags are generated from these fields (cli_flags.py): each default is written
here only. Kept free of numpy and aiohttp so that building the CLI parser stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tailserve.bench import DATASETS, DEFAULT_INPUT_LEN, DEFAULT_MIX, BenchError
from tailserve.errors import json_object

INF = float("inf")
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_percentiles(spec: str) -> list[float]:
    try:
        ps = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise BenchError(f"--percentiles wants numbers like 50,90,99,99.9; got {spec!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise BenchError(f"--percentiles must be in (0, 100], got {spec!r}")
    return ps


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in SLO_METRICS or ms <= 0:
            raise BenchError(f"--goodput wants NAME:MS with NAME in {', '.join(SLO_METRICS)} "
                             f"and MS > 0, e.g. ttft:500 tpot:50; got {item!r}")
        slos[name] = ms
    return slos


def parse_rates(spec: str) -> list[float] | None:
    try:
        rates = [float(r) for r in spec.split(",") if r.strip()]
    except ValueError:
        raise BenchError(f"--request-rates wants numbers like 1,2,4,8; got {spec!r}") from None
    return rates or None


def parse_extra_body(text: str) -> dict[str, Any] | None:
    if not text:
        return None
    return json_object(text, "--extra-body", error=BenchError)


def parse_timeout(text: str) -> float | None:
    seconds = float(text)
    return seconds if seconds > 0 else None


@dataclass(frozen=True)
class DatasetOptions:
    name: str = field(default="random", metadata={"flag": "dataset", "choices": DATASETS})
    path: str | None = field(
        default=None, metadata={"flag": "dataset_path", "help": "file for sharegpt / jsonl"})
    num_prompts: int = field(default=1000, metadata={"help": "requests per step"})
    input_len: int = field(
        default=DEFAULT_INPUT_LEN,
        metadata={"help": "prompt tokens (random, prefix: the part after the prefix)"})
    # None: the dataset's own (ShareGPT replies, jsonl lines), 128 for the synthetic ones.
    output_len: int | None = field(
        default=None, metadata={"help": "max_tokens (default: 128; sharegpt: the reply's length)"})
    range_ratio: float = field(
        default=0.0, metadata={"help": "lengths uniform in L·[1-X, 1+X]"})
    mix: str = field(
        default=DEFAULT_MIX, metadata={"help": "mixed: LEN:WEIGHT or IN/OUT:WEIGHT items"})
    prefix_len: int = field(default=256, metadata={"help": "prefix: shared tokens"})
    num_prefixes: int = field(default=4, metadata={"help": "prefix: distinct prefixes"})
    num_schemas: int = field(
        default=32, metadata={"help": "structured: distinct JSON schemas in the pool"})
    structured_share: float = field(
        default=1.0,
        metadata={"help": "structured: share of requests with a schema (the rest unconstrained)"})
    num_tools: int = field(default=4, metadata={"help": "tools: functions offered per request"})
    tool_choice: str = field(
        default="auto,required,named",
        metadata={"help": "tools: the tool_choice forms requests draw from (auto, required, "
                  "named: the question's own function), comma-separated"})
    endpoint: str = field(default="completions", metadata={"cli": False})
    seed: int = field(default=0, metadata={"cli": False})  # set per step from BenchConfig's


def _target(help_text: str = "", **more: Any) -> dict[str, Any]:
    return {"group": "target", "help": help_text, **more}


def _load(help_text: str = "", **more: Any) -> dict[str, Any]:
    return {"group": "load", "help": help_text, **more}


def _slo(help_text: str = "", **more: Any) -> dict[str, Any]:
    return {"group": "SLOs", "help": help_text, "metavar": "MS", **more}


def _output(help_text: str = "", **more: Any) -> dict[str, Any]:
    return {"group": "output", "help": help_text, **more}


@dataclass
class BenchConfig:
    base_url: str = field(
        default="http://127.0.0.1:8000", metadata=_target("server root, with or without /v1"))
    model: str | None = field(
        default=None, metadata=_target("model name (default: the server's first)"))
    endpoint: Literal["completions", "chat"] = field(default="completions", metadata=_target())
    api_key: str | None = field(
        default=None,
        metadata=_target("Bearer key (default: $OPENAI_API_KEY or $TAILSERVE_API_KEY)"))
    dataset: DatasetOptions = field(default_factory=DatasetOptions, metadata={"cli": False})
    request_rate: float = field(
        default=INF, metadata=_load("requests/s, or inf to send all at once"))
    request_rates: list[float] | None = field(
        default=None,
        metadata=_load("stepped load: one step per rate, e.g. 1,2,4,8", parse=parse_rates))
    sweep: bool = field(
        default=False,
        metadata=_load("with SLOs: a throughput step, then the capacity search (the highest "
                       "rates with >= 90%% and >= 99%% of requests meeting every SLO); "
                       "without: synchronous and throughput steps, then rates in between"))
    sweep_steps: int = field(
        default=4, metadata=_load("interpolated rates in a sweep without SLOs"))
    sweep_max_steps: int = field(
        default=8, metadata=_load("with SLOs: the most rates the capacity search runs"))
    sweep_tolerance: float = field(
        default=0.1,
        metadata=_load("with SLOs: the capacity search stops when the highest rate that met "
                       "the target and the lowest that missed it are within this ratio"))
    burstiness: float = field(
        default=1.0,
        metadata=_load("gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier"))
    max_concurrency: int | None = field(
        default=None, metadata=_load("cap on requests in flight"))
    goodput: dict[str, float] = field(
        default_factory=dict,
        metadata=_output("SLOs, e.g. ttft:500 tpot:50 e2el:2000", parse=parse_goodput,
                         nargs="+", metavar="NAME:MS"))
    # SLOs (bench/goodput.py): with any given, or published by the server, every step reports
    # its goodput (share and req/s meeting all of them), and --sweep searches the capacity.
    slo_ttft_ms: float | None = field(
        default=None,
        metadata=_slo("TTFT SLO: the most a request may wait for its first token (default: "
                      "the server's published SLO, if any)"))
    slo_itl_ms: float | None = field(
        default=None,
        metadata=_slo("ITL SLO: the longest gap a request may see between two streamed "
                      "chunks (every gap, measured by this client)"))
    slo_tpot_ms: float | None = field(
        default=None,
        metadata=_slo("TPOT SLO: the most a request's mean gap after its first token may be"))
    server_slos: bool = field(
        default=True,
        metadata={"group": "SLOs", "help": "with no SLO given, judge by the SLOs the server "
                  "publishes on /metrics (tailserve:slo_ttft_seconds, slo_itl_seconds)"})
    percentiles: list[float] = field(
        default_factory=lambda: [50.0, 90.0, 99.0, 99.9],
        metadata=_output(parse=parse_percentiles))
    warmup: int = field(default=0, metadata=_load("unmeasured requests first"))
    # Datasets and arrivals; step i draws its prompts with seed + i.
    seed: int = field(default=0, metadata={"group": "dataset"})
    save_result: str | None = field(
        default=None, metadata=_output("write the result JSON", metavar="PATH"))
    save_detailed: bool = field(
        default=False,
        metadata=_output("also per-request lists (vLLM's input_lens, ttfts, itls, texts)"))
    label: str | None = field(default=None, metadata=_output("a name stored in the result"))
    timeout_s: float | None = field(
        default=600.0,
        metadata=_target("per-request limit in seconds; 0 for none", flag="timeout",
                         parse=parse_timeout))
    tokenizer: str | None = field(
        default=None,
        metadata={"group": "dataset", "help": "HF folder or .gguf for lengths, or 'default' "
                  "for the bundled model (default: the server's /tokenize, else 4 chars/token)"})
    # None: on for the synthetic datasets, off for files.
    ignore_eos: bool | None = field(
        default=None,
        metadata=_target("ask for exactly max_tokens (default: on for random/mixed/prefix)"))
    extra_body: dict[str, Any] | None = field(
        default=None,
        metadata=_target("JSON merged into every request body", parse=parse_extra_body))
    progress: bool = field(default=True, metadata=_output("live progress bar"))
    observe: bool = field(
        default=True, metadata=_output("sample /metrics and collect /debug/timeline"))
    metrics_interval_s: float = field(
        default=1.0,
        metadata=_output("seconds between /metrics samples", flag="metrics_interval"))
    # "lean": bench/http11.py for http:// URLs (aiohttp for https://); "aiohttp": always.
    http_client: Literal["lean", "aiohttp"] = field(
        default="lean",
        metadata=_target("lean: a minimal HTTP/1.1 client for http:// (lowest client-added "
                         "latency); aiohttp: always aiohttp. https:// always uses aiohttp"))
    # Spin instead of sleeping around each request (see open_loop.open_loop); off by default.
    busy_poll: bool = field(
        default=False,
        metadata=_target("spin instead of sleeping from 2 ms before each send and while 1-4 "
                         "requests are in flight, so the OS's wake-up latency stays out of "
                         "TTFT; for low-rate latency runs on a host where the client has a "
                         "core to itself (costs up to one core while requests are in flight)"))
    argv: list[str] = field(default_factory=list, metadata={"cli": False})
    # Replicas behind a router (bench/replicas.py): each observed, each request attributed.
    replicas: list[str] = field(
        default_factory=list,
        metadata=_target("a replica behind the --base-url router (repeat): its /metrics, "
                         "/health and timeline are observed and each request is attributed "
                         "to the replica that served it", flag="replica", metavar="URL"))
    # Canary split (bench/canary.py): a second server and the share of users sent to it.
    base_url_b: str | None = field(
        default=None,
        metadata=_target("canary split: a second server; --split of the users go to it and "
                         "one result per arm is saved (PATH-A.json, PATH-B.json) for "
                         "tailserve compare"))
    split: float = field(default=0.1, metadata=_target("share of users sent to --base-url-b"))
    users: int = field(
        default=100,
        metadata=_target("synthetic users, each sticking to one arm by the FNV-1a hash of "
                         "its id"))
