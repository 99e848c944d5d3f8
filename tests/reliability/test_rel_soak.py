"""Soak: mixed open-loop load with early disconnects for SOAK_S seconds; the RSS of the API and
engine processes sampled every second, and the slope of each over the second half stated (MB
per minute) and bounded."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import numpy as np
import psutil

from server_util import ServerProcess
from test_server_lifecycle import (
    completion,
    engine_idle,
    engine_process,
    idle_summary,
    poll_metrics,
    stream_completion,
)

SOAK_S = 180.0
RATE_PER_S = 6.0
# A leak of 10 kB per request at this rate is 3.6 MB/min; warm-up (the engine's allocator
# meeting new batch shapes) is excluded by fitting the second half only.
MAX_SLOPE_MB_PER_MIN = 10.0


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    t = np.array([s[0] for s in samples]) / 60.0
    rss = np.array([s[1] for s in samples])
    return float(np.polyfit(t, rss, 1)[0])


def test_soak(long_model_dir: str, figures: dict[str, Any]) -> None:
    rng = random.Random(11)
    # A small timeline ring (default 20,000 records, ~20 MB when full): full within seconds,
    # so what the slope measures is growth that has no bound, not the ring filling up.
    with ServerProcess(["--max-num-seqs", "16", "--max-queue-len", "64",
                        "--timeline-buffer", "500"], model=long_model_dir) as srv:
        assert srv.proc is not None
        api, engine = psutil.Process(srv.proc.pid), engine_process(srv)
        rss: dict[str, list[tuple[float, float]]] = {"api": [], "engine": []}
        statuses: dict[int, int] = {}

        async def one(client: httpx.AsyncClient) -> None:
            kind = rng.random()
            max_tokens = rng.randint(8, 96)
            prompt = " ".join(rng.choice(["soak", "tail", "step", "block"])
                              for _ in range(rng.randint(2, 400)))
            if kind < 0.5:  # streamed, a third of them hung up early
                cancel = rng.randint(1, 8) if rng.random() < 0.33 else None
                res = await stream_completion(
                    client, srv.url, completion(max_tokens, stream=True, prompt=prompt),
                    cancel_after=cancel)
                status = res.status
            elif kind < 0.8:
                try:  # non-streamed, some given up on by the client
                    r = await asyncio.wait_for(client.post(
                        srv.url + "/v1/completions", json=completion(max_tokens, prompt=prompt)),
                        rng.choice([0.05, 0.3, 30.0]))
                    status = r.status_code
                except asyncio.TimeoutError:
                    status = -1
            else:
                r = await client.post(srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "ignore_eos": True})
                status = r.status_code
            statuses[status] = statuses.get(status, 0) + 1

        async def run() -> str:
            limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                start = time.monotonic()
                next_sample = start
                tasks: list[asyncio.Task[None]] = []
                t = start
                while t - start < SOAK_S:
                    t += rng.expovariate(RATE_PER_S)  # open loop: arrivals do not wait
                    while time.monotonic() < t:
                        now = time.monotonic()
                        if now >= next_sample:
                            rss["api"].append((now - start, api.memory_info().rss / 2**20))
                            rss["engine"].append((now - start, engine.memory_info().rss / 2**20))
                            next_sample += 1.0
                        await asyncio.sleep(min(t, next_sample) - now)
                    tasks.append(asyncio.create_task(one(client)))
                await asyncio.gather(*tasks)
                return await poll_metrics(client, srv.url, engine_idle, timeout=10.0)

        text = asyncio.run(run())
        log = srv.output()
    half = [len(v) // 2 for v in rss.values()]
    api_slope = slope_mb_per_min(rss["api"][half[0]:])
    engine_slope = slope_mb_per_min(rss["engine"][half[1]:])
    figures.update(
        seconds=SOAK_S, requests=sum(statuses.values()), statuses=statuses,
        api_rss_mb=[round(rss["api"][0][1]), round(rss["api"][-1][1])],
        engine_rss_mb=[round(rss["engine"][0][1]), round(rss["engine"][-1][1])],
        api_slope_mb_per_min=round(api_slope, 2), engine_slope_mb_per_min=round(engine_slope, 2),
    )
    assert engine_idle(text), idle_summary(text)
    assert not [s for s in statuses if s >= 500], statuses
    assert set(statuses) <= {200, 429, -1}, statuses
    assert "Traceback" not in log
    assert api_slope < MAX_SLOPE_MB_PER_MIN and engine_slope < MAX_SLOPE_MB_PER_MIN, figures
