"""One step against one server: its requests prepared before the clock starts, sent open-loop
at their scheduled times, observed on the server's side, and turned into the step's result.

A ``StepRunner`` holds what the steps of a run share for one server (its pre-flight info, the
HTTP client, the token counter, the run id); bench/run.py makes one per run (two in a canary
split, bench/canary.py) and asks it for the test request, the warm-up and each step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import time
import uuid
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np

from tailserve.bench import BenchError
from tailserve.bench.client import BenchClient, RequestResult, build_payload
from tailserve.bench.config import BenchConfig
from tailserve.bench.datasets import BenchRequest, DatasetOptions, load_dataset
from tailserve.bench.goodput import SloSpec
from tailserve.bench.http11 import LeanStreamClient
from tailserve.bench.observe import ObserverProcess
from tailserve.bench.open_loop import arrival_times, open_loop
from tailserve.bench.preflight import ServerInfo
from tailserve.bench.replicas import ReplicaInfo, replicas_block
from tailserve.bench.report import Progress, print_step
from tailserve.bench.result import StepData, build_result, environment
from tailserve.bench.tokens import TokenCounter


@dataclass(frozen=True)
class StepPlan:
    """What one step is: its name in the tables, its arrival rate (inf: all at once) and its
    concurrency cap (None: none)."""

    name: str
    rate: float
    max_concurrency: int | None


@dataclass
class StepRunner:
    """The steps of one run against one server (one per arm in a canary split)."""

    cfg: BenchConfig
    info: ServerInfo
    counter: TokenCounter
    headers: dict[str, str]
    client: BenchClient
    console: Any
    ignore_eos: bool
    loop_name: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    replicas: list[ReplicaInfo] = field(default_factory=list)  # --replica, probed
    slos: SloSpec = field(default_factory=SloSpec)  # what goodput judges (run_bench resolves)

    @property
    def client_name(self) -> str:
        return "lean" if isinstance(self.client, LeanStreamClient) else "aiohttp"

    def payload(self, req: BenchRequest) -> bytes:
        return build_payload(req, self.cfg.endpoint, self.info.model, self.ignore_eos,
                             self.cfg.extra_body)

    async def test_request(self) -> None:
        """One tiny request through the real path: a wrong endpoint, model, key or an
        unsupported parameter (ignore_eos on a server without it) fails here, with the
        server's own message, instead of as N failures."""
        res = RequestResult(-1, f"bench-{self.run_id}-test", 1, 2, 0.0)
        body = self.client.prepare(self.payload(BenchRequest("Hello", 1, 2)), res)
        await self.client.send(body, res, perf_counter())
        if not res.success:
            hint = " (is it an OpenAI-compatible server?)" if res.status == 404 else ""
            if self.ignore_eos and res.status == 400:
                hint = " (if the server rejects ignore_eos, pass --no-ignore-eos)"
            raise BenchError(f"the test request to {self.client.url} failed: "
                             f"{res.error_type}: {res.error}{hint}")

    async def warmup(self) -> None:
        # Its own seed, far from every step's (seed + step): warm-up prompts must not be the
        # first step's, or that step would start on a warm prefix cache.
        opts = dataclasses.replace(self.dataset_opts(0, self.cfg.warmup),
                                   seed=self.cfg.seed + 1_000_003)
        ds = load_dataset(opts, self.counter)
        self.console.print(f"warming up with {self.cfg.warmup} requests (not measured)")
        sem = asyncio.Semaphore(self.cfg.max_concurrency or len(ds.requests))

        async def one(i: int, req: BenchRequest) -> bool:
            async with sem:
                res = RequestResult(i, f"bench-{self.run_id}-warmup-{i}", 0, 0, 0.0)
                await self.client.send(self.client.prepare(self.payload(req), res), res,
                                       perf_counter())
                return res.success

        ok = await asyncio.gather(*(one(i, r) for i, r in enumerate(ds.requests)))
        if not all(ok):
            self.console.print(f"[yellow]warm-up: {ok.count(False)} of {len(ok)} failed[/]")

    def dataset_opts(self, step: int, n: int | None = None) -> DatasetOptions:
        # Each step its own prompts (seed + step): the same prompts again would hit the
        # server's prefix cache and make later steps look faster than they are.
        return dataclasses.replace(self.cfg.dataset, seed=self.cfg.seed + step,
                                   endpoint=self.cfg.endpoint,
                                   num_prompts=n or self.cfg.dataset.num_prompts)

    async def step(self, index: int, plan: StepPlan) -> dict[str, Any]:
        cfg = self.cfg
        t_prep = perf_counter()
        ds = load_dataset(self.dataset_opts(index), self.counter)
        warnings = list(ds.notes)
        if not self.counter.exact:
            warnings.append(f"prompt lengths are estimates ({self.counter.source})")
        mml = self.info.max_model_len
        too_long = sum(r.prompt_len + r.output_len > mml for r in ds.requests) if mml else 0
        if too_long:
            warnings.append(f"{too_long} requests need more than the server's max_model_len "
                            f"{mml} tokens; expect them to fail")
        rng = np.random.default_rng([cfg.seed, index, 1])
        arrivals = arrival_times(len(ds.requests), plan.rate, cfg.burstiness, rng)
        results = [
            RequestResult(i, f"bench-{self.run_id}-{index}-{i}", r.prompt_len, r.output_len,
                          float(arrivals[i]))
            for i, r in enumerate(ds.requests)
        ]
        # Every request's bytes before the clock starts: the send path only writes them.
        payloads = [self.client.prepare(self.payload(r), res)
                    for r, res in zip(ds.requests, results, strict=True)]
        self.console.print(
            f"step {index} [bold]{plan.name}[/]: {len(results)} {ds.name} requests, "
            f"burstiness {cfg.burstiness:g}, max concurrency {plan.max_concurrency or '-'} "
            f"(prepared in {perf_counter() - t_prep:.1f} s)")
        observer = None
        reps = self.replicas
        # With --replica the --base-url is not observed: a router answers /metrics and
        # /debug/timeline by forwarding them to one of its workers, so they would be some
        # replica's, a different one from call to call.
        main = cfg.observe and bool(self.info.metrics_names or self.info.has_timeline) and \
            not reps
        if main or (cfg.observe and reps):
            observer = ObserverProcess(
                self.info.base_url if main else None, self.headers,
                bool(self.info.metrics_names), self.info.has_timeline, cfg.metrics_interval_s,
                [(r.url, r.metrics, r.timeline) for r in reps] if cfg.observe else None)
            observer.start()
        load_before = os.getloadavg()
        # Everything allocated so far is long-lived: keep the collector from walking it
        # mid-run (a full collection is a pause inside the measured window).
        gc.collect()
        gc.freeze()
        interrupted = False
        try:
            with Progress(self.console, len(results), plan.name, cfg.progress) as progress:
                # The clock starts after the bar's first draw (a few ms of rendering).
                t0_wall, t0 = time.time(), perf_counter()
                try:
                    await open_loop([self.client] * len(payloads), payloads, results,
                                     plan.max_concurrency, t0, progress, cfg.busy_poll)
                finally:
                    duration = perf_counter() - t0
        except asyncio.CancelledError:
            interrupted = True  # Ctrl-C: report what was sent; bench/run.py runs no more
        finally:
            gc.unfreeze()
            server = observer.stop() if observer is not None else None
        observed = server.pop("replicas", None) if server is not None else None
        if not main:
            server = None
        if interrupted:
            sent = [r for r in results if r.send_s is not None]
            warnings.append(f"interrupted after {duration:.1f} s: {len(sent)} of "
                            f"{len(results)} requests sent; those in flight count as failed "
                            "(cancelled)")
            results = sent
        self.fill_output_tokens(results)
        result = build_result(cfg, self.info, self.counter, StepData(
            index=index, name=plan.name, rate=plan.rate, max_concurrency=plan.max_concurrency,
            dataset=ds, dataset_options=self.dataset_opts(index), ignore_eos=self.ignore_eos,
            results=results, duration_s=duration, start_time=t0_wall, start_perf_counter=t0,
            server=server, warnings=warnings, interrupted=interrupted, run_id=self.run_id,
            environment=environment(cfg.argv, self.info, self.loop_name, load_before,
                                    self.client_name, cfg.busy_poll),
        ), self.slos)
        if observed is not None:
            ts = result["tailserve"]
            ts |= replicas_block(reps, observed, ts["requests"])
            for o in ts["replicas"]:
                steps = sum(r.get("kind") == "step" for r in o.get("timeline") or [])
                bad = sum(h.get("status") != 200 for h in o.get("health") or [])
                self.console.print(f"replica {o['url']}: {o['num_requests']} requests, "
                                   f"{steps} steps, {len(o['metric_samples'])} /metrics "
                                   f"samples, /health failed {bad} times")
        print_step(self.console, result, cfg.percentiles)
        return result

    def fill_output_tokens(self, results: list[RequestResult]) -> None:
        """A server that sends no usage: count the text (exact tokenizer) or, failing that,
        the content chunks; the source is recorded per request."""
        for r in results:
            if r.success and r.output_tokens is None:
                if self.counter.exact:
                    r.output_tokens = self.counter.count(r.text) if r.text else 0
                    r.output_tokens_source = "tokenizer"
                else:
                    r.output_tokens = 1 + len(r.itl_s)
                    r.output_tokens_source = "chunks"
