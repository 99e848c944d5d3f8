"""Abort storm (1,000 streams hung up mid-response) and burst shedding (200 against 4 + 8)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_util import ServerProcess, metric_value
from test_server_lifecycle import (
    aborts,
    assert_openai_error,
    completion,
    engine_idle,
    idle_summary,
    poll_metrics,
    stream_completion,
)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


@pytest.fixture(scope="module")
def storm_server(long_model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(["--max-num-seqs", "64"], model=long_model_dir) as srv:
        yield srv


def test_abort_storm_of_1000(storm_server: ServerProcess, figures: dict[str, Any]) -> None:
    """1,000 streaming clients, 200 at a time, each hanging up after 1 to 5 chunks: exactly
    1,000 client_disconnect aborts, the engine idle with every block free shortly after the
    last hang-up, and a greedy answer unchanged by the storm."""
    url = storm_server.url
    n, wave = 1000, 200
    rng = random.Random(7)
    reference = completion(48, prompt="The storm")

    async def run() -> tuple[str, str, float, str, str]:
        limits = httpx.Limits(max_connections=wave + 10, max_keepalive_connections=wave + 10)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            before_text = (await client.post(url + "/v1/completions", json=reference)).json()
            before = (await client.get(url + "/metrics")).text
            expected = (aborts(before, "client_disconnect") or 0) + n
            for start in range(0, n, wave):
                results = await asyncio.gather(*[
                    stream_completion(client, url, completion(4000, stream=True),
                                      cancel_after=rng.randint(1, 5))
                    for _ in range(start, min(n, start + wave))
                ])
                assert all(r.status == 200 and r.cancelled for r in results), [
                    (r.status, r.body[:200]) for r in results if not r.cancelled][:3]
            last_hang_up = time.monotonic()
            after = await poll_metrics(
                client, url,
                lambda t: engine_idle(t) and aborts(t, "client_disconnect") == expected,
                timeout=30.0,
            )
            drained_s = time.monotonic() - last_hang_up
            after_text = (await client.post(url + "/v1/completions", json=reference)).json()
        return before, after, drained_s, before_text["choices"][0]["text"], \
            after_text["choices"][0]["text"]

    before, after, drained_s, text_before, text_after = asyncio.run(run())
    figures["drained_after_last_hang_up_s"] = round(drained_s, 3)
    assert engine_idle(after), idle_summary(after)
    assert aborts(after, "client_disconnect") == (aborts(before, "client_disconnect") or 0) + n
    assert text_after == text_before
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert "Traceback" not in storm_server.output()


def test_burst_is_shed(tiny_model_dir: str, figures: dict[str, Any]) -> None:
    """200 at once against max_num_seqs 4 + max_queue_len 8, three rounds: 12 admitted and
    served in full, 188 refused with 429 (Retry-After, OpenAI body) before any admitted one
    finished; the refusals' latency is recorded (no time is asserted: that is the
    benchmark's, benchmarks/burst_shed.py)."""
    n, max_tokens, capacity = 200, 64, 12
    with ServerProcess(["--max-num-seqs", "4", "--max-queue-len", "8"],
                       model=tiny_model_dir) as srv:
        url = srv.url
        refused_s: list[float] = []

        async def one(client: httpx.AsyncClient) -> tuple[httpx.Response, float, float]:
            t0 = time.monotonic()
            r = await client.post(url + "/v1/completions", json=completion(max_tokens))
            return r, t0, time.monotonic()

        for _ in range(3):
            async def run() -> list[tuple[httpx.Response, float, float]]:
                limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                    return list(await asyncio.gather(*[one(client) for _ in range(n)]))

            results = asyncio.run(run())
            admitted = [x for x in results if x[0].status_code == 200]
            rejected = [x for x in results if x[0].status_code == 429]
            assert len(admitted) == capacity and len(rejected) == n - capacity, sorted(
                {x[0].status_code for x in results})
            for r, _, _ in admitted:
                assert r.json()["usage"]["completion_tokens"] == max_tokens
            for r, _, _ in rejected:
                assert r.headers["retry-after"] == "1"
                assert_openai_error(r.json(), "rate_limit_error", "queue_full")
            assert max(t for _, _, t in rejected) < min(t for _, _, t in admitted)
            refused_s += [t1 - t0 for _, t0, t1 in rejected]
        text = httpx.get(url + "/metrics", timeout=10).text
        assert metric_value(text, "tailserve:requests_rejected_total",
                            {"reason": "queue_full"}) == 3 * (n - capacity)
    figures["refused_p50_ms"] = round(1e3 * pct(refused_s, 50), 1)
    figures["refused_p99_ms"] = round(1e3 * pct(refused_s, 99), 1)
