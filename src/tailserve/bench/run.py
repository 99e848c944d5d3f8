"""A bench run: the flags checked, pre-flight, then its steps -- stepped rates or the sweep.

Steps: one (``--request-rate``), one per rate (``--request-rates 1,2,4``), or ``--sweep``.
With SLOs (given, or published by the server: bench/goodput.py) the sweep finds the
*capacity*: a throughput step (all at once) measures what the server can carry, then the
capacity search (bench/capacity.py: a geometric ladder from half that rate, then bisection,
at most ``--sweep-max-steps`` rates) finds the highest rates at which >= 90% and >= 99% of
requests meet every SLO. Without SLOs a synchronous step (one request at a time) and a
throughput step measure the two ends, then ``--sweep-steps`` rates evenly between them are
run. Each step (bench/step.py, sent open-loop by bench/open_loop.py) has its own result;
several steps end with a summary table and a latency-vs-rate plot.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tailserve.bench import BenchError
from tailserve.bench.capacity import Point, SearchOptions, capacity_summary, next_rate
from tailserve.bench.client import ENDPOINT_PATHS, BenchClient
from tailserve.bench.config import BenchConfig
from tailserve.bench.goodput import SloSpec, resolve_slos
from tailserve.bench.http11 import HTTP_CLIENTS, make_client
from tailserve.bench.open_loop import INF
from tailserve.bench.preflight import ServerInfo, SyncHTTP, normalize_base_url, preflight
from tailserve.bench.replicas import probe_replicas
from tailserve.bench.report import print_capacity, print_sweep
from tailserve.bench.result import check_writable, save_results
from tailserve.bench.step import StepPlan, StepRunner
from tailserve.bench.tokens import TokenCounter, make_counter

SYNTHETIC = ("random", "mixed", "prefix")


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
    runner = StepRunner(cfg, info, counter, headers, client, console, ignore_eos, loop_name,
                        slos=slos)
    if cfg.replicas:
        runner.replicas = probe_replicas(cfg.replicas, headers)
    await runner.test_request()
    if info_b is not None:
        return await _canary(runner, info_b, session)
    if cfg.warmup > 0:
        await runner.warmup()
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
        steps.append(await runner.step(len(steps), plan))
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


async def _canary(runner: StepRunner, info_b: ServerInfo, session: aiohttp.ClientSession
                  ) -> list[dict[str, Any]]:
    from tailserve.bench.canary import canary_step, save_arms

    cfg = runner.cfg
    client_b = make_client(cfg.http_client, info_b.base_url + ENDPOINT_PATHS[cfg.endpoint],
                           runner.headers, cfg.timeout_s, session)
    try:
        runner_b = dataclasses.replace(runner, info=info_b, client=client_b, run_id=runner.run_id)
        await runner_b.test_request()
        for c in (runner, runner_b):
            if cfg.warmup > 0:
                await c.warmup()
        arms = await canary_step({"A": runner, "B": runner_b}, runner.console)
    finally:
        await client_b.close()
    if cfg.save_result:
        save_arms(cfg.save_result, arms, runner.console)
    return arms


def _rate_name(rate: float) -> str:
    return "inf" if rate == INF else f"{rate:.4g} req/s"
