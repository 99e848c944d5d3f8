"""Slow and oversized clients: lone surrogates everywhere, huge prompts (the API process's
memory comes back), 10 MB bodies and huge headers, and 50 connections dripping their headers
a byte at a time while normal clients are served."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from server_util import ServerProcess
from test_server_errors import SURROGATE_CASES, check_error_body
from test_server_lifecycle import completion

HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server(long_model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(["--header-timeout", str(HEADER_TIMEOUT_S)],
                       model=long_model_dir) as srv:
        yield srv


def test_lone_surrogates_are_400s(server: ServerProcess) -> None:
    """Every surrogate case, 20 times over and concurrently: 400 naming the field, never 500."""
    async def run() -> list[tuple[httpx.Response, str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            calls = [
                (client.post(path, content=json.dumps(body),
                             headers={"content-type": "application/json"}), param)
                for _ in range(20) for path, body, _, param in SURROGATE_CASES
            ]
            responses = await asyncio.gather(*[c for c, _ in calls])
            return list(zip(responses, [p for _, p in calls], strict=True))

    for response, param in asyncio.run(run()):
        assert response.status_code == 400, response.text
        check_error_body(response.text, param)


def test_huge_prompts_do_not_hold_memory(server: ServerProcess, figures: dict[str, Any]) -> None:
    """Three rounds of 8 prompts just under the byte bound (tokenized, then 400: too many
    tokens) and 8 over it (400 before tokenizing), with /health polled throughout: every
    answer a 400, /health always 200, and the API process's RSS back within 50 MB of where it
    started."""
    assert server.proc is not None
    api = psutil.Process(server.proc.pid)
    start_mb = api.memory_info().rss / 2**20
    near = "the quick brown fox jumps over the lazy dog " * 14_000  # ~616 kB, 8k tokens x 82
    over = near * 2

    async def run() -> tuple[list[int], list[int], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            health: list[int] = []
            done = asyncio.Event()
            peak = 0.0

            async def poll() -> None:
                nonlocal peak
                while not done.is_set():
                    health.append((await client.get("/health")).status_code)
                    peak = max(peak, api.memory_info().rss / 2**20)
                    await asyncio.sleep(0.05)

            poller = asyncio.create_task(poll())
            codes: list[int] = []
            for _ in range(3):
                rs = await asyncio.gather(*[
                    client.post("/v1/completions", json={"prompt": p, "max_tokens": 1})
                    for p in [near] * 8 + [over] * 8
                ])
                codes += [r.status_code for r in rs]
            done.set()
            await poller
            return codes, health, peak

    codes, health, peak = asyncio.run(run())
    time.sleep(1.0)  # the trim runs on a tokenize worker once the last one is answered
    end_mb = api.memory_info().rss / 2**20
    figures.update(api_rss_start_mb=round(start_mb), api_rss_peak_mb=round(peak),
                   api_rss_after_mb=round(end_mb), health_polls=len(health))
    assert set(codes) == {400}
    assert health and set(health) == {200}
    assert end_mb < start_mb + 50, (start_mb, peak, end_mb)


def test_oversized_bodies_and_headers(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        big = client.post("/v1/completions", content=b"x" * (10 << 20),
                          headers={"content-type": "application/json"})
        assert big.status_code == 413, big.text
        huge_headers = client.get("/v1/models", headers={f"x-pad-{i}": "y" * 1000
                                                         for i in range(40)})
        assert huge_headers.status_code == 431, huge_headers.text
        assert client.get("/health").status_code == 200


def test_fifty_slowloris_connections(server: ServerProcess, figures: dict[str, Any]) -> None:
    """50 connections sending their headers a byte every 0.2 s are answered 408 and closed
    within the header timeout (plus the poll); normal requests meanwhile get served."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: slow\r\nX-Pad: " + b"a" * 200

    async def drip() -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        t0 = time.monotonic()
        got = b""

        async def read() -> None:
            nonlocal got
            got = await reader.read()

        reading = asyncio.create_task(read())
        for byte in request:
            if reading.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.2)
        await asyncio.wait_for(reading, 10)
        writer.close()
        return got, time.monotonic() - t0

    async def normal(client: httpx.AsyncClient) -> int:
        r = await client.post("/v1/completions", json=completion(4))
        return r.status_code

    async def run() -> tuple[list[tuple[bytes, float]], list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            drips = asyncio.gather(*[drip() for _ in range(50)])
            await asyncio.sleep(0.5)
            served = [await normal(client) for _ in range(10)]
            return list(await drips), served

    drips, served = asyncio.run(run())
    figures["slowloris_closed_after_s_max"] = round(max(t for _, t in drips), 2)
    assert served == [200] * 10
    for got, elapsed in drips:
        assert got.startswith(b"HTTP/1.1 408 "), got[:100]
        assert elapsed < HEADER_TIMEOUT_S + 1.5, elapsed
