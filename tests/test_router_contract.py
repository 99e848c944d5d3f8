"""The router contract, live: the ``vllm:`` gauges the Gateway API Inference Extension's model
server protocol (and vLLM-aware routers) read, scraped from a real ``tailserve serve`` and
checked against their ``tailserve:`` twins, idle and under load; ``/health`` 200 when ready;
``--no-enable-vllm-metrics`` leaves every ``vllm:`` family out.

The tiny random model's tokens are random, so requests set ``ignore_eos`` and run for
``max_tokens``; a 4096-token context keeps two streams busy for as long as the test looks.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import ServerProcess, metric_value

CONTEXT = 4096
ROUTED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-router") / "llama", max_position_embeddings=CONTEXT
    )


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


def check_twins(text: str, model_name: str) -> dict[str, float]:
    """Each routed vllm: gauge is one series labelled model_name, equal to its tailserve: twin
    from the same scrape; returns the values."""
    values = {}
    for name in ROUTED:
        ours = metric_value(text, "tailserve:" + name)
        assert ours is not None, name
        assert samples(text, "vllm:" + name) == [({"model_name": model_name}, ours)], name
        values[name] = ours
    return values


def test_vllm_gauges_match_their_twins_idle_and_under_load(model_dir: str) -> None:
    args = ["--max-num-seqs", "1", "--block-size", "16", "--dtype", "float32"]
    with ServerProcess(args, model=model_dir) as srv:
        url = srv.url
        # The protocol's readiness probe: 200 once ready to serve.
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        model_name = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        idle = httpx.get(url + "/metrics", timeout=10).text
        assert check_twins(idle, model_name) == {
            "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
        }
        total = metric_value(idle, "tailserve:kv_cache_total_blocks")
        assert total is not None and total > 0
        assert samples(idle, "vllm:cache_config_info") == [({
            "block_size": "16", "num_gpu_blocks": str(int(total)),
            "enable_prefix_caching": "True", "cache_dtype": "float32",
        }, 1.0)]

        async def under_load() -> str:
            # max_num_seqs 1: one stream runs while the other waits, until they are closed.
            body = {"prompt": "Hello there", "max_tokens": CONTEXT - 64, "ignore_eos": True,
                    "temperature": 0.0, "stream": True}
            async with httpx.AsyncClient(timeout=30) as client:

                async def stream() -> None:
                    # Reads until cancelled; the waiting one gets its headers only when it runs.
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_bytes():
                            pass

                tasks = [asyncio.create_task(stream()) for _ in range(2)]
                try:
                    for _ in range(200):
                        text = (await client.get(url + "/metrics")).text
                        if (metric_value(text, "tailserve:num_requests_running") == 1
                                and metric_value(text, "tailserve:num_requests_waiting") == 1):
                            break
                        await asyncio.sleep(0.05)
                    return text
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)

        busy = asyncio.run(under_load())
        values = check_twins(busy, model_name)
        assert values["num_requests_running"] == 1 and values["num_requests_waiting"] == 1
        free = metric_value(busy, "tailserve:kv_cache_free_blocks")
        assert free is not None
        # The running stream holds blocks; the fraction is the blocks' own.
        assert values["kv_cache_usage_perc"] == pytest.approx(1.0 - free / total)
        assert 0.0 < values["kv_cache_usage_perc"] < 1.0

        # After the streams are closed the engine drains back to idle, under both names.
        for _ in range(200):
            after = httpx.get(url + "/metrics", timeout=10).text
            if metric_value(after, "tailserve:kv_cache_free_blocks") == total:
                break
            time.sleep(0.05)
        assert check_twins(after, model_name) == {
            "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
        }
        assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_no_enable_vllm_metrics_exports_no_vllm_family(model_dir: str) -> None:
    with ServerProcess(["--no-enable-vllm-metrics"], model=model_dir) as srv:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        families = {f.name for f in text_string_to_metric_families(text)}
        assert not {f for f in families if f.startswith("vllm:")}, families
        assert "vllm:" not in text
        # The tailserve: gauges are unaffected.
        assert metric_value(text, "tailserve:num_requests_running") == 0
        assert metric_value(text, "tailserve:kv_cache_total_blocks") is not None
