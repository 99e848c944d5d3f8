"""The engine killed (SIGKILL) under load, and a SIGTERM drain under load."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx

from server_util import ServerProcess
from test_server_lifecycle import (
    assert_no_engine_left,
    assert_openai_error,
    completion,
    engine_process,
    stream_completion,
)


def test_engine_killed_under_load(long_model_dir: str, figures: dict[str, Any]) -> None:
    """Eight streams running; the engine process gets SIGKILL: /health turns 503 within a
    second, every stream ends (an error event, never a hang), new requests get 503
    engine_dead, and the server exits non-zero by itself."""
    with ServerProcess([], model=long_model_dir) as srv:
        engine = engine_process(srv)

        async def run() -> tuple[float, list[Any], httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                started = [asyncio.Event() for _ in range(8)]
                streams = [asyncio.create_task(stream_completion(
                    client, srv.url, completion(8000, stream=True), first_chunk=ev))
                    for ev in started]
                await asyncio.wait_for(asyncio.gather(*[ev.wait() for ev in started]), 60)
                engine.kill()
                killed = time.monotonic()
                while (await client.get(srv.url + "/health")).status_code == 200:
                    await asyncio.sleep(0.005)
                unhealthy_s = time.monotonic() - killed
                refused = await client.post(srv.url + "/v1/completions", json=completion(4))
                results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            return unhealthy_s, list(results), refused

        unhealthy_s, results, refused = asyncio.run(run())
        code = srv.wait(timeout=30)
        figures["unhealthy_after_kill_s"] = round(unhealthy_s, 3)
        assert unhealthy_s < 1.0
        assert refused.status_code == 503, refused.text
        assert_openai_error(refused.json(), "service_unavailable", "engine_dead")
        for res in results:
            assert res.status == 200 and len(res.errors) == 1 and res.done, res.events[-2:]
            assert res.errors[0]["type"] == "engine_error"
        assert code == 1
        assert_no_engine_left(srv, engine.pid)


def test_drain_under_load(long_model_dir: str, figures: dict[str, Any]) -> None:
    """SIGTERM with 16 streams in flight (8 short, 8 that cannot finish) and --shutdown-timeout
    2: the short ones end whole, the long ones end "abort" with [DONE], new work gets 503
    draining, and the server exits 0 with no engine left."""
    with ServerProcess(["--shutdown-timeout", "2"], model=long_model_dir) as srv:
        engine_pid = engine_process(srv).pid

        async def run() -> tuple[list[Any], httpx.Response, float]:
            async with httpx.AsyncClient(timeout=60) as client:
                lengths = [32, 8000] * 8
                started = [asyncio.Event() for _ in lengths]
                streams = [asyncio.create_task(stream_completion(
                    client, srv.url, completion(m, stream=True), first_chunk=ev))
                    for m, ev in zip(lengths, started, strict=True)]
                await asyncio.wait_for(asyncio.gather(*[ev.wait() for ev in started]), 60)
                srv.signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.1)
                refused = await client.post(srv.url + "/v1/completions", json=completion(4))
                results = await asyncio.wait_for(asyncio.gather(*streams), 30)
                return list(results), refused, signalled

        results, refused, signalled = asyncio.run(run())
        code = srv.wait(timeout=30)
        figures["exited_after_sigterm_s"] = round(time.monotonic() - signalled, 2)
        assert refused.status_code == 503
        assert_openai_error(refused.json(), "service_unavailable", "draining")
        for i, res in enumerate(results):
            assert res.status == 200 and res.done and res.errors == [], res.events[-2:]
            assert res.finish_reasons == (["length"] if i % 2 == 0 else ["abort"])
        assert code == 0
        assert_no_engine_left(srv, engine_pid)
