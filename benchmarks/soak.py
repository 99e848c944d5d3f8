"""An hour of mixed traffic from several tenants through vllm-router to two replicas, and what
it did to them (issue 34; ``make soak``, not in ``make test``).

    python benchmarks/soak.py                      # 60 minutes
    python benchmarks/soak.py --minutes 3 --rate 1 # a short check

Open-loop Poisson arrivals from three tenants of a keys file (``--api-keys``, salted cache,
weights 1/1/2, one with a rate limit), mixing streamed and plain completions and chats
(``ignore_eos``, so every answer must be exactly ``max_tokens`` long), early disconnects,
prompts over ``max_model_len``, malformed bodies and wrong keys. Halfway, replica 1 gets
SIGTERM (it drains), exits, and is started again on its port; the router's health checks take
it out and back. Every 10 s the RSS of each replica's API and engine process is sampled (with
its anonymous and file-backed parts: a leak grows the first). At the end, once the replicas
are idle: their KV blocks free.

The report (stdout; ``--out`` for its JSON): requests by outcome, kind and tenant; 5xx (must
be 0); wrong-length outputs (0); RSS first/last and the slope over the last 40 minutes (the
second half of a shorter run); KV blocks free at the end (all); P99 TTFT and ITL of streamed
requests per ``--window-minutes`` window. The exit status is 1 when any of those fails.
Without vllm-router the clients talk to one replica and nothing is restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from soak_report import Outcome, RssSample, print_report, summarize

ROOT = Path(__file__).resolve().parent.parent
# name, weight, share of the traffic, extra keys-file fields
TENANTS = [("alpha", 1.0, 0.5, {}), ("beta", 1.0, 0.3, {"max_requests_per_s": 2}),
           ("gamma", 2.0, 0.2, {})]
KINDS = [("normal", 0.72), ("disconnect", 0.10), ("oversized", 0.06), ("malformed", 0.06),
         ("bad_key", 0.06)]
MAX_MODEL_LEN = 1024
WORDS = ("tail", "block", "step", "queue", "tenant", "prefix", "token", "batch", "cache", "soak")
SAMPLE_EVERY_S = 10.0
KV_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks",
             "kv_cache_total_blocks")


def key_of(tenant: str) -> str:
    return f"sk-soak-{tenant}-0123456789"


def load_serve_replicas() -> Any:
    spec = importlib.util.spec_from_file_location(
        "serve_replicas", ROOT / "deploy" / "router" / "serve_replicas.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_replicas"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


class Replica:
    def __init__(self, index: int, port: int, cmd: list[str], env: dict[str, str],
                 log: Path) -> None:
        self.index, self.url, self.cmd, self.env, self.log = (
            index, f"http://127.0.0.1:{port}", cmd, env, log)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.index} exited ({self.proc.returncode}); "
                                   f"see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"replica {self.index} not healthy within {timeout_s:.0f} s")

    def processes(self) -> dict[str, psutil.Process]:
        """Its API process and its engine (the spawned child, not the resource tracker)."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        try:
            api = psutil.Process(self.proc.pid)
            out = {"api": api}
            for child in api.children(recursive=True):
                cmd = " ".join(child.cmdline())
                if "spawn_main" in cmd and "resource_tracker" not in cmd:
                    out["engine"] = child
            return out
        except psutil.Error:
            return {}

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (it drains), then SIGKILL to its group if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def status_mb(pid: int) -> tuple[float, float, float]:
    """(VmRSS, RssAnon, RssFile) in MB from /proc (0s where unreadable)."""
    vals = {"VmRSS": 0.0, "RssAnon": 0.0, "RssFile": 0.0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in vals:
                vals[name] = float(rest.split()[0]) / 1024.0
    except OSError:
        pass
    return vals["VmRSS"], vals["RssAnon"], vals["RssFile"]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, t: float) -> Outcome:
    tenant = rng.choices([t[0] for t in TENANTS], [t[2] for t in TENANTS])[0]
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    headers = {"Authorization": f"Bearer {key_of(tenant) if kind != 'bad_key' else 'sk-nope'}"}
    max_tokens = rng.randint(8, 64)
    chat = rng.random() < 0.3
    stream = kind == "disconnect" or rng.random() < 0.5
    body: Any = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    text = prompt(rng, 4000 if kind == "oversized" else rng.randint(4, 300))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")
    out = Outcome(t, kind, tenant, "ok")
    try:
        if kind == "malformed":
            content = rng.choice([b"{not json", b'{"prompt": 5, "max_tokens": "x"}',
                                  b'{"prompt": "hi", "max_tokens": -1}',
                                  b'{"prompt": "hi", "temperature": "hot"}'])
            r = await client.post(url + "/v1/completions", content=content,
                                  headers=headers | {"content-type": "application/json"})
            return _status(out, r.status_code)
        if not stream:
            r = await client.post(path, json=body, headers=headers)
            if r.status_code != 200:
                return _status(out, r.status_code)
            got = r.json()["usage"]["completion_tokens"]
            out.outcome = "ok" if got == max_tokens else "wrong_length"
            return out
        return await _stream(client, path, body, headers, out, max_tokens,
                             rng.randint(1, 5) if kind == "disconnect" else None)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out.outcome = f"transport:{type(exc).__name__}"
        return out


def _status(out: Outcome, status: int) -> Outcome:
    out.outcome = "ok" if status == 200 else f"{status // 100}xx:{status}"
    return out


async def _stream(client: httpx.AsyncClient, path: str, body: Any, headers: dict[str, str],
                  out: Outcome, max_tokens: int, cancel_after: int | None) -> Outcome:
    sent = time.monotonic()
    last: float | None = None
    chunks, usage = 0, None
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return _status(out, resp.status_code)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if not any(c.get("text") or (c.get("delta") or {}).get("content")
                       for c in event.get("choices", ())):
                continue
            now = time.monotonic()
            if last is None:
                out.ttft_s = now - sent
            else:
                out.itl_s.append(now - last)
            last = now
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                out.outcome = "disconnected"
                return out
    got = None if usage is None else usage.get("completion_tokens")
    out.outcome = "ok" if got == max_tokens else "wrong_length"
    return out


async def traffic(args: argparse.Namespace, url: str, replicas: list[Replica],
                  restart: bool) -> tuple[list[Outcome], list[RssSample], list[dict[str, Any]]]:
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    rss: list[RssSample] = []
    events: list[dict[str, Any]] = []
    duration = args.minutes * 60.0
    start = time.monotonic()

    async def sampler() -> None:
        while True:
            now = time.monotonic() - start
            for r in replicas:
                for name, proc in r.processes().items():
                    total, anon, file = status_mb(proc.pid)
                    if total:
                        rss.append(RssSample(now, f"replica{r.index}/{name}", proc.pid, total,
                                             anon, file))
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def restarter() -> None:
        await asyncio.sleep(duration / 2)
        r = replicas[1]
        events.append({"t": time.monotonic() - start, "what": f"SIGTERM to replica 1 ({r.url})"})
        code = await asyncio.to_thread(r.stop)
        events.append({"t": time.monotonic() - start,
                       "what": f"replica 1 exited with status {code}; starting it again"})
        r.start()
        await asyncio.to_thread(r.wait_healthy, args.startup_timeout)
        events.append({"t": time.monotonic() - start, "what": "replica 1 healthy again"})

    async def record(client: httpx.AsyncClient, t: float) -> None:
        outcomes.append(await one(client, url, rng, t))

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        sampling = asyncio.create_task(sampler())
        restarting = asyncio.create_task(restarter()) if restart else None
        tasks = []
        t = 0.0
        while True:
            t += rng.expovariate(args.rate)
            if t >= duration:
                break
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(record(client, t)))
        await asyncio.gather(*tasks)
        if restarting is not None:
            await restarting  # a short run still sees its replica back
        sampling.cancel()
    return outcomes, rss, events


def kv_at_end(replicas: list[Replica], timeout_s: float = 60.0) -> dict[str, Any]:
    """Each replica's KV blocks once it is idle (running and waiting 0), or at the timeout."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for r in replicas:
        deadline = time.monotonic() + timeout_s
        vals: dict[str, float] = {}
        while True:
            try:
                text = httpx.get(r.url + "/metrics", timeout=10).text
            except httpx.HTTPError:
                text = ""
            vals = {s.name.removeprefix("tailserve:"): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples
                    if s.name.removeprefix("tailserve:") in KV_GAUGES}
            idle = vals.get("num_requests_running") == 0 and vals.get("num_requests_waiting") == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        free, total = vals.get("kv_cache_free_blocks"), vals.get("kv_cache_total_blocks")
        out[f"replica{r.index}"] = {"free_blocks": free, "total_blocks": total,
                                    "all_free": free is not None and free == total}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second, all tenants")
    p.add_argument("--window-minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=34)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--base-port", type=int, default=18300)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--out", default=None, help="write the report's JSON here")
    p.add_argument("--logs", default=None, help="keep the servers' logs in this folder")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0:
        p.error("--minutes and --rate must be > 0")
    sr = load_serve_replicas()
    router_bin = sr.find_router(None)
    folder = Path(args.logs or tempfile.mkdtemp(prefix="tailserve-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    keys = folder / "keys.jsonl"
    keys.write_text("".join(json.dumps({"key": key_of(n), "name": n, "weight": w, **extra}) + "\n"
                            for n, w, _, extra in TENANTS))
    n = 2 if router_bin else 1
    threads = sr.split_threads(args.threads, n)
    serve = [sys.executable, "-m", "tailserve.cli", "serve", *([args.model] if args.model else []),
             "--api-keys", str(keys), "--cache-salt-by-tenant", "--max-model-len",
             str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-queue-len", "32",
             "--timeline-buffer", "500", "--host", "127.0.0.1", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    replicas = [Replica(i, args.base_port + 1 + i, [*serve, "--port", str(args.base_port + 1 + i)],
                        {**env, "OMP_NUM_THREADS": str(threads[i])}, folder / f"replica{i}.log")
                for i in range(n)]
    router: subprocess.Popen[bytes] | None = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy(args.startup_timeout)
        url = replicas[0].url
        if router_bin:
            ns = argparse.Namespace(host="127.0.0.1", port=args.base_port, policy="round_robin",
                                    router_log_level="warning", router_arg=[])
            cmd = sr.router_command(ns, router_bin, [sr.Replica(r.url, 0, None) for r in replicas])
            with open(folder / "router.log", "ab") as log:
                router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            url = f"http://127.0.0.1:{args.base_port}"
            sr.wait_healthy(url, router, 60.0, "vllm-router")
        outcomes, rss, events = asyncio.run(traffic(args, url, replicas, restart=n > 1))
        kv = kv_at_end(replicas)
    finally:
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        for r in replicas:
            r.stop()
    setup = {"replicas": n, "router": bool(router_bin), "rate_per_s": args.rate,
             "threads": threads, "tenants": [t[:3] for t in TENANTS], "logs": str(folder),
             "model": args.model or "bundled SmolLM2-135M-Instruct"}
    rep = summarize(outcomes, rss, kv, args.minutes, args.window_minutes, events, setup)
    print_report(rep)
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1))
    v = rep["verdict"]
    return 0 if v["no_5xx"] and v["no_wrong_length"] and v["kv_all_free"] \
        and v["rss_slope_below_0.5_mb_per_min"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
