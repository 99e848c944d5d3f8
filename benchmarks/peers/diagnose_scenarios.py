"""Planted-cause runs of `tailserve bench` against real peers, for `tailserve diagnose`.

Each scenario starts its server (benchmarks/peers/start_*.sh; tailserve serve), runs one bench
step with /metrics observed, stops the server, and leaves the result JSON in --out. The
scenarios' expected causes are in SCENARIOS; tests/peers/test_diagnose_peers.py (`make
peers-test`) runs them and asserts diagnose names them, and tests/fixtures/diagnose/ keeps a
few recorded results (gzipped) so `make test` checks the adapters without the peers.

    python benchmarks/peers/diagnose_scenarios.py --out /tmp/diag vllm-starved llama-queue

vLLM takes ~2 minutes to start; servers are started once per distinct setting. vLLM exports
its request spans to a collector of the harness's own (span_collector.py), which writes them
to ``<scenario>-spans.jsonl`` beside the result, for ``diagnose --otlp-traces``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from serving_peers import SERVED_NAME, Server, server_for, stop, wait_ready  # noqa: E402

# OpenTelemetry's batch span processor exports every 5 s by default.
SPAN_FLUSH_S = 6.0


@dataclass(frozen=True)
class Scenario:
    server: str  # "vllm" | "llamacpp" | "tailserve"
    server_args: tuple[str, ...]
    bench_args: tuple[str, ...]
    expect: dict[str, str]  # metric -> the cause diagnose must name first
    # (start, seconds) after the bench starts: one busy-loop process per core of this host
    # for that long, the planted CPU contention.
    burn: tuple[float, float] | None = None


def _load(n: int, inp: int, out: int, *load: str) -> tuple[str, ...]:
    return ("--dataset", "random", "--input-len", str(inp), "--output-len", str(out),
            "--num-prompts", str(n), *load)


# A KV pool of 8 blocks of 128 tokens (vLLM-CPU's default block size; 1,024 tokens) for 12
# requests of 224 + 64 tokens: four prompts fill it, the rest wait for blocks, and a running
# request is preempted when its 257th token needs a third block. --enforce-eager: start-up in
# well under a minute instead of compiling.
STARVED = ("--num-gpu-blocks-override", "8", "--max-model-len", "512", "--enforce-eager")
# Room for every request, but four sequences at a time.
FOUR = ("--max-num-seqs", "4", "--max-model-len", "2048", "--enforce-eager")
# Short chats decoding 128 tokens while 1,500-token prompts arrive: below capacity, so the
# ITL tail is decodes held by the long prompts' prefill steps.
_INTERFERE = ("--dataset", "mixed", "--mix", "32/128:0.75,1500/4:0.25", "--num-prompts", "24",
              "--request-rate", "1")
# One request at a time, 30 of them; the host's cores are taken from 30% to 65% of the way.
_SINGLE30 = _load(30, 32, 96, "--max-concurrency", "1")
SCENARIOS: dict[str, Scenario] = {
    "vllm-starved": Scenario("vllm", STARVED, _load(12, 224, 64, "--request-rate", "inf"),
                             {"ttft": "kv_cache_pressure", "itl": "preemption"}),
    "vllm-clean-single": Scenario("vllm", STARVED,
                                  _load(10, 32, 16, "--max-concurrency", "1"),
                                  {"ttft": "none", "itl": "none", "tpot": "none"}),
    "vllm-queue": Scenario("vllm", FOUR, _load(16, 64, 32, "--request-rate", "inf"),
                           {"ttft": "queueing"}),
    "vllm-interference": Scenario("vllm", FOUR, _INTERFERE, {"itl": "prefill_interference"}),
    "vllm-contention": Scenario("vllm", FOUR, _SINGLE30,
                                {"itl": "cpu_contention"}, burn=(0.3, 0.35)),
    "llama-queue": Scenario("llamacpp", ("--parallel", "2"),
                            _load(12, 64, 32, "--request-rate", "inf"), {"ttft": "queueing"}),
    "llama-clean-single": Scenario("llamacpp", (), _load(12, 32, 32, "--max-concurrency", "1"),
                                   {"ttft": "none", "itl": "none", "tpot": "none"}),
    "tailserve-clean-single": Scenario("tailserve", (),
                                       _load(24, 32, 32, "--max-concurrency", "1"),
                                       {"ttft": "none", "itl": "none", "tpot": "none"}),
    "tailserve-queue": Scenario("tailserve", ("--max-num-seqs", "2"),
                                _load(16, 64, 32, "--request-rate", "inf"), {"ttft": "queueing"}),
    # A KV pool of ~1,000 tokens (46 KiB a token in float32) for vLLM's starved load.
    "tailserve-starved": Scenario("tailserve", ("--kv-cache-memory", "0.045",
                                                "--max-model-len", "512"),
                                  _load(12, 224, 64, "--request-rate", "inf"),
                                  # tailserve admits optimistically (--admission-policy):
                                  # the starved pool preempts, before first tokens too. (The
                                  # ITL tail is the victims' gaps and the recompute prefills
                                  # in their neighbours' gaps: preemption or interference
                                  # first, run to run.)
                                  {"ttft": "preemption"}),
    # Whole prompts in one step, with no ITL SLO to size the steps: what vLLM does by default.
    "tailserve-interference": Scenario("tailserve", ("--no-enable-chunked-prefill",
                                                     "--slo-itl-ms", "none"), _INTERFERE,
                                       {"itl": "prefill_interference"}),
    "tailserve-contention": Scenario("tailserve", ("--max-num-seqs", "2"), _SINGLE30,
                                     {"itl": "cpu_contention"}, burn=(0.3, 0.35)),
}


def bench(server: Server, sc: Scenario, out: str) -> None:
    base = [sys.executable, "-m", "tailserve.cli", "bench", "--base-url", server.url,
            "--model", SERVED_NAME, "--tokenizer", "default", "--ignore-eos", "--seed", "0",
            "--no-progress", *sc.bench_args]
    cmd = [*base, "--save-result", out]
    env = os.environ | {"PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                   "src")}
    if sc.burn is None:
        subprocess.run(cmd, check=True, env=env)
        return
    # The run's length is not known beforehand: a clean pass first (unplanted, not kept)
    # times it from its first step's line to its end, and the burn starts and stops at its
    # fractions of that in the measured pass.
    proc = subprocess.Popen(base, env=env, stdout=subprocess.PIPE)
    length = _time_from_first_step(proc)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE)
    burners: list[subprocess.Popen[bytes]] = []
    try:
        _wait_first_step(proc)
        time.sleep(sc.burn[0] * length)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(BURNERS_PER_CORE * (os.cpu_count() or 1))]
        time.sleep(sc.burn[1] * length)
    finally:
        for b in burners:
            b.kill()
            b.wait()
        _drain(proc)
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)


# Eight busy loops per core: a server with a thread per core keeps a small share of the host
# (its threads spin while they wait for each other, so fewer loops leave it most of it).
BURNERS_PER_CORE = 8
_FIRST_STEP = b"step 0"  # bench prints it when the step's first request is about to leave


def _wait_first_step(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.buffer.write(line)
        if _FIRST_STEP in line:
            return
    raise RuntimeError("bench ended before its first step")


def _drain(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.buffer.write(line)


def _time_from_first_step(proc: subprocess.Popen[bytes]) -> float:
    _wait_first_step(proc)
    t0 = time.monotonic()
    _drain(proc)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return time.monotonic() - t0


def run(names: list[str], out_dir: str, peers_home: str) -> dict[str, str]:
    """Run the scenarios (grouped by server setting); their result paths by name."""
    os.makedirs(out_dir, exist_ok=True)
    paths: dict[str, str] = {}
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for n in names:
        sc = SCENARIOS[n]
        groups.setdefault((sc.server, sc.server_args), []).append(n)
    for (name, extra), members in groups.items():
        spans = None
        if name == "vllm":
            from span_collector import SpanFileCollector

            spans = SpanFileCollector(os.path.join(out_dir, f"vllm-{len(paths)}-spans.jsonl"))
            spans.start()
            extra = (*extra, "--otlp-traces-endpoint", spans.url)
        server = server_for(name, list(extra), peers_home,
                            llama_threads=int(os.environ.get("LLAMA_THREADS", "1")))
        if spans is not None:
            server.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        log = open(os.path.join(out_dir, f"{name}-{len(paths)}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(server.cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=server.env, start_new_session=True)
        try:
            err = wait_ready(proc, server, 600.0)
            if err is not None:
                raise RuntimeError(err)
            for n in members:
                paths[n] = os.path.join(out_dir, f"{n}.json")
                bench(server, SCENARIOS[n], paths[n])
            if spans is not None:
                time.sleep(SPAN_FLUSH_S)  # the last requests' spans leave in the next batch
        finally:
            stop(proc)  # SIGTERM: vLLM's span processor flushes what it holds on exit
            log.close()
            if spans is not None:
                spans.stop()
        if spans is not None:
            # One file per server: each scenario's requests join their own spans by id.
            for n in members:
                if os.path.exists(spans.path):
                    shutil.copyfile(spans.path, os.path.join(out_dir, f"{n}-spans.jsonl"))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--peers-home", default=os.path.expanduser("~/.cache/tailserve-peers"))
    ns = ap.parse_args()
    for n, p in run(ns.scenarios, ns.out, ns.peers_home).items():
        print(n, p)


if __name__ == "__main__":
    main()
