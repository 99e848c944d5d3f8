"""Open-loop load: the arrival schedule, one step, stepped rates and the sweep, the result.

A step sends N requests at times drawn *before* it starts from a gamma renewal process
(``arrival_times``), each in its own task, so a slow server cannot slow the arrivals: there
is no coordinated omission. With ``--max-concurrency`` a request whose time has come waits
for a free slot; either way the lag between its scheduled and actual send is recorded.

Steps: one (``--request-rate``), one per rate (``--request-rates 1,2,4``), or ``--sweep``.
With SLOs (given, or published by the server: bench/goodput.py) the sweep finds the
*capacity*: a throughput step (all at once) measures what the server can carry, then the
capacity search (bench/capacity.py: a geometric ladder from half that rate, then bisection,
at most ``--sweep-max-steps`` rates) finds the highest rates at which >= 90% and >= 99% of
requests meet every SLO. Without SLOs a synchronous step (one request at a time) and a
throughput step measure the two ends, then ``--sweep-steps`` rates evenly between them are
run. Each step has its own result; several steps end with a summary table and a
latency-vs-rate plot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import aiohttp
import numpy as np

from tailserve.bench import BenchError
from tailserve.bench.capacity import Point, SearchOptions, capacity_summary, next_rate
from tailserve.bench.client import ENDPOINT_PATHS, BenchClient, RequestResult, build_payload
from tailserve.bench.config import BenchConfig
from tailserve.bench.datasets import BenchRequest, DatasetOptions, load_dataset
from tailserve.bench.goodput import SloSpec, resolve_slos
from tailserve.bench.http11 import HTTP_CLIENTS, LeanStreamClient, make_client
from tailserve.bench.observe import ObserverProcess
from tailserve.bench.preflight import ServerInfo, SyncHTTP, normalize_base_url, preflight
from tailserve.bench.replicas import ReplicaInfo, probe_replicas, replicas_block
from tailserve.bench.report import Progress, print_capacity, print_step, print_sweep
from tailserve.bench.result import (
    StepData,
    build_result,
    check_writable,
    environment,
    save_results,
)
from tailserve.bench.tokens import TokenCounter, make_counter

SYNTHETIC = ("random", "mixed", "prefix")
INF = float("inf")
# --busy-poll: the sender stops sleeping this long before a scheduled send and spins to it, so
# the timer's OS wake-up (up to a millisecond or two late on a busy VM) lands before the send,
# not inside it.
BUSY_POLL_LEAD_S = 0.002
# --busy-poll spins only while at most this many requests are in flight: with more, the event
# loop has reads to serve anyway and a spinner would only take CPU from them (and from a server
# on the same host), so the loop waits in epoll as it does without the option.
BUSY_POLL_MAX_IN_FLIGHT = 4


def arrival_times(n: int, rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Scheduled send times (seconds after the step starts) of ``n`` requests.

    The gaps are gamma distributed with mean 1/rate and shape ``burstiness``: 1 is a Poisson
    process, below 1 burstier, above 1 more regular (gap CV = 1/sqrt(burstiness)); vLLM's
    parametrisation. The first request goes at 0. Unlike vLLM the schedule is not rescaled
    to end at exactly N/rate: rescaling would make every run's mean rate exact by fiat.
    """
    if not rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if rate == INF:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(0, n - 1))
    return np.concatenate([np.zeros(min(n, 1)), np.cumsum(gaps)])


@dataclass(frozen=True)
class StepPlan:
    name: str
    rate: float
    max_concurrency: int | None


def run_bench(cfg: BenchConfig, console: Any = None) -> list[dict[str, Any]]:
    """Pre-flight, then every step; returns the step results (also printed and saved)."""
    from rich.console import Console

    console = console or Console()
    if cfg.endpoint not in ENDPOINT_PATHS:
        raise BenchError(f"--endpoint must be completions or chat, got {cfg.endpoint!r}")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {cfg.max_concurrency}")
    if cfg.http_client not in HTTP_CLIENTS:
        raise BenchError(f"--http-client must be one of {', '.join(HTTP_CLIENTS)}, got "
                         f"{cfg.http_client!r}")
    if cfg.sweep and cfg.request_rates:
        raise BenchError("--sweep and --request-rates are two ways to choose rates: pick one")
    if cfg.replicas and cfg.base_url_b:
        raise BenchError("--replica observes the replicas behind one --base-url; a canary "
                         "split (--base-url-b) compares two servers: use one or the other")
    if cfg.base_url_b:
        from tailserve.bench import canary

        canary.validate(cfg)
    if cfg.save_result:
        check_writable(cfg.save_result)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    base = normalize_base_url(cfg.base_url)
    http = SyncHTTP(base, headers)
    info = preflight(http, cfg.model, cfg.api_key)
    info_b = None
    if cfg.base_url_b:
        http_b = SyncHTTP(normalize_base_url(cfg.base_url_b), headers)
        try:
            info_b = preflight(http_b, cfg.model, cfg.api_key)
        finally:
            http_b.close()
    counter = make_counter(cfg.tokenizer, http, info.model, info.has_tokenize)
    slos = resolve_slos(cfg.slo_ttft_ms, cfg.slo_itl_ms, cfg.slo_tpot_ms, cfg.goodput,
                        info.published_slos if cfg.server_slos else None)
    console.print(f"[bold]tailserve bench[/] → {base} model [bold]{info.model}[/] "
                  f"({cfg.endpoint}); lengths from {counter.source}")
    if slos:
        whose = "given" if slos.source == "client" else "the server's published SLOs"
        console.print(f"goodput: requests with {slos.describe()} ({whose})")
    if info_b is not None:
        console.print(f"canary arm B → {info_b.base_url} model [bold]{info_b.model}[/]")
    try:
        import uvloop

        return uvloop.run(_bench(cfg, info, counter, headers, console, "uvloop", info_b, slos))
    except ImportError:
        return asyncio.run(_bench(cfg, info, counter, headers, console, "asyncio", info_b,
                                  slos))
    finally:
        http.close()


async def _bench(cfg: BenchConfig, info: ServerInfo, counter: TokenCounter,
                 headers: dict[str, str], console: Any, loop_name: str,
                 info_b: ServerInfo | None = None, slos: SloSpec | None = None
                 ) -> list[dict[str, Any]]:
    ignore_eos = cfg.ignore_eos if cfg.ignore_eos is not None else cfg.dataset.name in SYNTHETIC
    # No pool limit: --max-concurrency is enforced by a semaphore, so a capped run and an
    # uncapped one use the same connection behaviour (kept alive, reused).
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = make_client(cfg.http_client, info.base_url + ENDPOINT_PATHS[cfg.endpoint],
                             headers, cfg.timeout_s, session)
        try:
            return await _steps(cfg, info, counter, headers, console, loop_name, info_b,
                                session, client, ignore_eos, slos or SloSpec())
        finally:
            await client.close()


async def _steps(cfg: BenchConfig, info: ServerInfo, counter: TokenCounter,
                 headers: dict[str, str], console: Any, loop_name: str,
                 info_b: ServerInfo | None, session: aiohttp.ClientSession,
                 client: BenchClient, ignore_eos: bool, slos: SloSpec
                 ) -> list[dict[str, Any]]:
    ctx = _Ctx(cfg, info, counter, headers, client, console, ignore_eos, loop_name, slos=slos)
    if cfg.replicas:
        ctx.replicas = probe_replicas(cfg.replicas, headers)
    await ctx.test_request()
    if info_b is not None:
        return await _canary(ctx, info_b, session)
    if cfg.warmup > 0:
        await ctx.warmup()
    search = cfg.sweep and bool(slos)
    if search:
        plans = [StepPlan("throughput", INF, cfg.max_concurrency)]
    elif cfg.sweep:
        plans = [StepPlan("synchronous", INF, 1),
                 StepPlan("throughput", INF, cfg.max_concurrency)]
    else:
        rates = cfg.request_rates or [cfg.request_rate]
        plans = [StepPlan(_rate_name(r), r, cfg.max_concurrency) for r in rates]
    steps: list[dict[str, Any]] = []

    async def run(plan: StepPlan) -> bool:
        steps.append(await ctx.step(len(steps), plan))
        return not steps[-1]["tailserve"]["interrupted"]

    for plan in plans:
        if not await run(plan):
            break
    capacity = None
    if search and steps and not steps[-1]["tailserve"]["interrupted"]:
        await _capacity_search(cfg, steps, run)
        capacity = capacity_summary(steps, search_options(cfg))
        print_capacity(console, capacity, slos)
    elif cfg.sweep and len(steps) == 2 and not steps[-1]["tailserve"]["interrupted"]:
        lo, hi = steps[0]["request_throughput"], steps[1]["request_throughput"]
        if not hi > lo > 0:
            console.print(f"[yellow]sweep: throughput {hi:.3g} req/s is not above the "
                          f"synchronous rate {lo:.3g} req/s; no rates in between[/]")
        else:
            for k in range(1, cfg.sweep_steps + 1):
                r = lo + (hi - lo) * k / (cfg.sweep_steps + 1)
                if not await run(StepPlan(_rate_name(r), r, cfg.max_concurrency)):
                    break
    if len(steps) > 1:
        print_sweep(console, steps, cfg.percentiles)
    if cfg.save_result:
        save_results(cfg.save_result, cfg.label, steps, console,
                     {"capacity": capacity} if capacity is not None else None)
    return steps


def search_options(cfg: BenchConfig) -> SearchOptions:
    try:
        return SearchOptions(max_steps=cfg.sweep_max_steps, tolerance=cfg.sweep_tolerance)
    except ValueError as exc:
        raise BenchError(str(exc)) from None


async def _capacity_search(cfg: BenchConfig, steps: list[dict[str, Any]],
                           run: Callable[[StepPlan], Awaitable[bool]]) -> None:
    """After the throughput step: rates from bench/capacity.py's planner, one step each."""
    opts = search_options(cfg)
    peak = float(steps[-1]["request_throughput"] or 0.0)
    if not peak > 0:
        return  # nothing completed at full load: no rate to start from
    points: list[Point] = []
    while (rate := next_rate(points, peak / 2, opts)) is not None:
        if not await run(StepPlan(_rate_name(rate), rate, cfg.max_concurrency)):
            return
        share = (steps[-1]["tailserve"].get("goodput") or {}).get("goodput_share")
        points.append(Point(rate, share))


async def _canary(ctx: _Ctx, info_b: ServerInfo, session: aiohttp.ClientSession
                  ) -> list[dict[str, Any]]:
    from tailserve.bench.canary import canary_step, save_arms

    cfg = ctx.cfg
    client_b = make_client(cfg.http_client, info_b.base_url + ENDPOINT_PATHS[cfg.endpoint],
                           ctx.headers, cfg.timeout_s, session)
    try:
        ctx_b = dataclasses.replace(ctx, info=info_b, client=client_b, run_id=ctx.run_id)
        await ctx_b.test_request()
        for c in (ctx, ctx_b):
            if cfg.warmup > 0:
                await c.warmup()
        arms = await canary_step({"A": ctx, "B": ctx_b}, ctx.console)
    finally:
        await client_b.close()
    if cfg.save_result:
        save_arms(cfg.save_result, arms, ctx.console)
    return arms


def _rate_name(rate: float) -> str:
    return "inf" if rate == INF else f"{rate:.4g} req/s"


@dataclass
class _Ctx:
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
        opts = dataclasses.replace(self._dataset_opts(0, self.cfg.warmup),
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

    def _dataset_opts(self, step: int, n: int | None = None) -> DatasetOptions:
        # Each step its own prompts (seed + step): the same prompts again would hit the
        # server's prefix cache and make later steps look faster than they are.
        return dataclasses.replace(self.cfg.dataset, seed=self.cfg.seed + step,
                                   endpoint=self.cfg.endpoint,
                                   num_prompts=n or self.cfg.dataset.num_prompts)

    async def step(self, index: int, plan: StepPlan) -> dict[str, Any]:
        cfg = self.cfg
        t_prep = perf_counter()
        ds = load_dataset(self._dataset_opts(index), self.counter)
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
                    await _open_loop([self.client] * len(payloads), payloads, results,
                                     plan.max_concurrency, t0, progress, cfg.busy_poll)
                finally:
                    duration = perf_counter() - t0
        except asyncio.CancelledError:
            interrupted = True  # Ctrl-C: report what was sent, then stop (see _bench)
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
        self._fill_output_tokens(results)
        result = build_result(cfg, self.info, self.counter, StepData(
            index=index, name=plan.name, rate=plan.rate, max_concurrency=plan.max_concurrency,
            dataset=ds, dataset_options=self._dataset_opts(index), ignore_eos=self.ignore_eos,
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

    def _fill_output_tokens(self, results: list[RequestResult]) -> None:
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


def _yield_cpu() -> None:
    """One turn of a busy-poll spin: give the CPU to anything waiting for it (the server
    this client just woke up, say). Without it a spinner on a 2-core host with one core
    taken holds its core for a whole scheduler slice (measured: the server waited ~4 ms,
    one 250 Hz tick, for 1% of requests); with it the waiting task runs at once and the
    spin resumes when it is done. A no-op syscall when nothing waits."""
    if _sched_yield is not None:
        _sched_yield()


_sched_yield = getattr(os, "sched_yield", None)


async def _open_loop(clients: list[BenchClient], payloads: list[bytes],
                     results: list[RequestResult],
                     max_concurrency: int | None, t0: float, progress: Progress,
                     busy_poll: bool = False) -> None:
    """Send every request at its scheduled time, each in its own task.

    ``busy_poll`` (``--busy-poll``): for low-rate latency measurements on a host where the
    client has a core to itself. Waiting in the event loop, the client pays the OS's wake-up
    latency twice per request: the timer's wake-up before the send and epoll's after the
    response lands. With ``busy_poll`` the sender sleeps until ``BUSY_POLL_LEAD_S`` before a
    send and then spins to it, and while 1 to ``BUSY_POLL_MAX_IN_FLIGHT`` requests are in
    flight a spinner task yields to the loop without ever sleeping: each loop turn then
    polls the sockets with a zero timeout, so a read is taken (and stamped by the client's
    read callback, where it always is) as soon as it arrives. The stamps stay where they are:
    the send stamp right before the write, the first-byte stamp at the read that carried the
    first content. With nothing due and nothing in flight, or more than
    ``BUSY_POLL_MAX_IN_FLIGHT`` in flight, the loop waits in epoll as without the option.
    """
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    next_send = [INF]  # perf_counter time of the next scheduled send, for the progress bar
    in_flight = [0]
    spin_wake = asyncio.Event()  # set when in_flight changes: the parked spinner re-checks

    async def spin() -> None:
        while True:
            if 0 < in_flight[0] <= BUSY_POLL_MAX_IN_FLIGHT:
                # A ready callback makes the next loop turn poll with timeout 0: this
                # process never sleeps while a response it is waiting for can arrive.
                _yield_cpu()
                await asyncio.sleep(0)
            else:
                spin_wake.clear()
                await spin_wake.wait()

    async def one(i: int) -> None:
        try:
            await clients[i].send(payloads[i], results[i], t0)  # per request: a canary's arm
        except asyncio.CancelledError:
            results[i].error_type = "cancelled"
            results[i].error = "the run was interrupted while this request was in flight"
            raise
        finally:
            in_flight[0] -= 1
            spin_wake.set()
            if sem is not None:
                sem.release()
            progress.finished(results[i].success)
            # Just after a response and (if this was the last in flight) long before the
            # next send: the one moment a redraw delays nothing that is measured.
            progress.idle(next_send[0] - perf_counter())

    tasks = []
    watcher = asyncio.create_task(progress.watch())
    spinner = asyncio.create_task(spin()) if busy_poll else None
    try:
        for i, res in enumerate(results):
            due = next_send[0] = t0 + res.scheduled_s
            # A loop, not one sleep: the event loop's timers have millisecond resolution and
            # can fire up to half a millisecond early; a request must never go before its time.
            while (delay := due - perf_counter()) > 0:
                if not busy_poll or in_flight[0] > BUSY_POLL_MAX_IN_FLIGHT:
                    await asyncio.sleep(delay)
                elif delay > BUSY_POLL_LEAD_S:
                    await asyncio.sleep(delay - BUSY_POLL_LEAD_S)
                else:
                    _yield_cpu()
                    await asyncio.sleep(0)  # spin: I/O is still served every turn
            if sem is not None:
                await sem.acquire()
            progress.sent()
            in_flight[0] += 1
            spin_wake.set()
            tasks.append(asyncio.create_task(one(i)))
        next_send[0] = INF
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        # Ctrl-C: stop sending, cancel what is in flight, let the caller report what was sent.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        watcher.cancel()
        if spinner is not None:
            spinner.cancel()
