"""Server overhead: the HTTP server against ``LLM.generate`` on the same requests, in one run.

Two questions, each answered side by side on this machine:

  A. throughput -- one request set through ``LLM.generate`` (all at once), then through
     ``tailserve serve`` by ``--concurrency`` streaming clients (the issue: 64). Target: the
     server's output tokens/s >= 90% of the offline engine's.
  B. step time under many connections -- ``--many`` requests (the issue: 256) offline, then
     through the server with one streaming client each, all connected at once. The engine's P99
     step time in the server (from /debug/timeline step records) against offline (from
     ``LLM.step_stats``). Target: <= 1.1x.

On a CPU host the API process and the engine share the cores, so HTTP, SSE and
detokenization work shows up here as engine slowdown -- which is what a user would see.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/server_overhead.py            # defaults below
    python benchmarks/server_overhead.py --num-prompts 8 --many 16 --output-len-range 8 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from offline_throughput import (
    RequestSpec,
    load_average,
    machine_info,
    make_requests,
    special_token_ids,
)
from tailserve import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import free_port


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def offline(llm: LLM, reqs: list[RequestSpec]) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in reqs]
    llm.step_stats.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = [s.step_s for s in llm.step_stats]
    return {
        "wall_s": wall, "output_tokens": tokens, "output_tps": tokens / wall,
        "num_steps": len(steps), "step_p50_ms": 1e3 * percentile(steps, 50),
        "step_p99_ms": 1e3 * percentile(steps, 99),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


async def one_stream(client: httpx.AsyncClient, url: str, r: RequestSpec) -> list[int] | int:
    body = {
        "model": "bench", "prompt": r.prompt_token_ids, "max_tokens": r.output_len,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code
        usage = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        return [usage]


async def through_server(url: str, reqs: list[RequestSpec], concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        async def guarded(r: RequestSpec) -> list[int] | int:
            async with sem:
                return await one_stream(client, url, r)

        t_start = time.time()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(r) for r in reqs))
        wall = time.perf_counter() - t0
        timeline = (await client.get(url + "/debug/timeline",
                                     params={"since": t_start})).json()["records"]
    errors = [r for r in results if isinstance(r, int)]
    tokens = sum(r[0] for r in results if isinstance(r, list))
    steps = [rec["step_s"] for rec in timeline if rec["kind"] == "step"]
    return {
        "wall_s": wall, "output_tokens": tokens, "output_tps": tokens / wall,
        "errors": len(errors), "num_steps": len(steps),
        "step_p50_ms": 1e3 * percentile(steps, 50), "step_p99_ms": 1e3 * percentile(steps, 99),
        "max_running": max((rec["num_running"] for rec in timeline if rec["kind"] == "step"),
                           default=0),
    }


class Server:
    def __init__(self, engine_args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tailserve.cli", "serve", "--port", str(self.port),
                    "--served-model-name", "bench", "--log-level", "warning",
                    "--timeline-buffer", "200000", *engine_args]

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.cmd)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not come up")

    def __exit__(self, *exc: Any) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--many", type=int, default=256, help="connected clients in part B")
    ap.add_argument("--input-len-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len-range", type=int, nargs=2, default=[100, 512])
    ap.add_argument("--many-output-len-range", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--many-input-len-range", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engine = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory,
              "max_num_batched_tokens": 512}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args),
                               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                               "load_average_start": load_average()}
    print("machine:", results["machine"], "load:", results["load_average_start"], flush=True)

    llm = LLM(**engine)
    cfg = llm.engine.loaded.config
    excluded = special_token_ids(llm.tokenizer)
    llm.generate([{"prompt_token_ids": [t for t in range(100, 116)]}],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    set_a = make_requests(args.num_prompts, tuple(args.input_len_range),
                          tuple(args.output_len_range), cfg.vocab_size, excluded, args.seed)
    set_b = make_requests(args.many, tuple(args.many_input_len_range),
                          tuple(args.many_output_len_range), cfg.vocab_size, excluded,
                          args.seed + 1)
    off_a = off_b = None
    if not args.skip_a:
        print(f"[A] offline: {len(set_a)} requests ...", flush=True)
        off_a = offline(llm, set_a)
        print(f"    {off_a['output_tps']:.1f} out tok/s, wall {off_a['wall_s']:.1f} s", flush=True)
    if not args.skip_b:
        print(f"[B] offline: {len(set_b)} requests ...", flush=True)
        off_b = offline(llm, set_b)
        print(f"    step P50 {off_b['step_p50_ms']:.1f} ms, P99 {off_b['step_p99_ms']:.1f} ms",
              flush=True)
    del llm  # free its KV pool before the server allocates its own

    with Server(flags) as srv:
        # Warm-up through the server too (first-call costs in the engine process).
        asyncio.run(through_server(srv.url, set_b[:2], 2))
        if off_a is not None:
            print(f"[A] server: {len(set_a)} requests, {args.concurrency} streaming clients ...",
                  flush=True)
            on_a = asyncio.run(through_server(srv.url, set_a, args.concurrency))
            ratio = on_a["output_tps"] / off_a["output_tps"]
            print(f"    {on_a['output_tps']:.1f} out tok/s = {ratio:.3f} x offline "
                  f"(target >= 0.90); errors {on_a['errors']}", flush=True)
            off_a.pop("token_ids")
            results["A"] = {"offline": off_a, "server": on_a, "ratio": ratio}
        if off_b is not None:
            print(f"[B] server: {len(set_b)} streaming clients at once ...", flush=True)
            on_b = asyncio.run(through_server(srv.url, set_b, len(set_b)))
            ratio_b = on_b["step_p99_ms"] / off_b["step_p99_ms"]
            print(f"    step P50 {on_b['step_p50_ms']:.1f} ms, P99 {on_b['step_p99_ms']:.1f} ms"
                  f" = {ratio_b:.3f} x offline P99 (target <= 1.1); errors {on_b['errors']}",
                  flush=True)
            off_b.pop("token_ids")
            results["B"] = {"offline": off_b, "server": on_b, "p99_ratio": ratio_b}
    results["load_average_end"] = load_average()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k in ("A", "B")}, indent=2))


if __name__ == "__main__":
    main()
