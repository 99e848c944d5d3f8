"""--assert-steady-memory: the check's arithmetic, and a live server under 500 mixed requests."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_util import ServerProcess, metric_value
from tailserve.obs.memory import SteadyMemoryCheck

MIB = float(1 << 20)


def test_check_takes_the_warmup_peak_and_warns_per_tolerance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = SteadyMemoryCheck(is_cuda=False, tolerance_bytes=10 * MIB, warmup_requests=2)

    def feed(rss_mib: float, finished: int) -> dict[str, float]:
        mem = {"rss_bytes": rss_mib * MIB, "kv_cache_bytes": 50 * MIB}
        check.observe(mem, finished)
        return mem

    with caplog.at_level(logging.WARNING, logger="tailserve.obs.memory"):
        assert "steady_growth_bytes" not in feed(100, 0)  # warming up
        feed(120, 1)  # the warm-up peak: 170 MiB with the pool
        mem = feed(110, 2)
        assert mem["steady_baseline_bytes"] == 170 * MIB and mem["steady_growth_bytes"] == 0
        assert feed(125, 3)["steady_growth_bytes"] == 5 * MIB  # within tolerance
        assert not caplog.records
        mem = feed(190, 4)  # +70 MiB
        assert mem["steady_growth_bytes"] == 70 * MIB and mem["steady_violations_total"] == 1
        assert feed(195, 5)["steady_violations_total"] == 1  # less than another tolerance
        assert feed(215, 6)["steady_violations_total"] == 2  # +95 > 70 + 10
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].startswith("steady memory: RSS + KV pool grew 70.0 MiB over the "
                                  "post-warm-up baseline 170.0 MiB (tolerance 10.0 MiB)")
    assert "not known on CPU" in warnings[0]


def test_cuda_without_reserved_bytes_is_skipped() -> None:
    check = SteadyMemoryCheck(is_cuda=True, tolerance_bytes=MIB, warmup_requests=0)
    mem = {"rss_bytes": 1e9}
    check.observe(mem, 5)
    assert check.baseline is None and "steady_growth_bytes" not in mem


# ---------------------------------------------------------------- live

WARMUP = 24
TOLERANCE_MIB = 64
LENGTHS = (4, 256)  # prompt tokens; the tiny model's context is 512
MAX_TOKENS = (1, 16)


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    args = ["--max-num-seqs", "8", "--assert-steady-memory",
            "--steady-memory-warmup", str(WARMUP),
            "--steady-memory-tolerance", str(TOLERANCE_MIB)]
    with ServerProcess(args, model=tiny_model_dir, env={"TAILSERVE_API_KEY": ""}) as srv:
        yield srv


def _post(client: httpx.Client, url: str, prompt_len: int, max_tokens: int, seed: int) -> int:
    rng = random.Random(seed)
    body = {"prompt": [rng.randrange(100, 1000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True}
    return client.post(url + "/v1/completions", json=body).status_code


def test_500_mixed_requests_after_warmup_keep_memory_steady(server: ServerProcess) -> None:
    url = server.url
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=16)) as client:
        # Warm-up covers the extremes (longest prompt, longest output) at full concurrency.
        warm = [(LENGTHS[i % 2], MAX_TOKENS[(i // 2) % 2]) for i in range(WARMUP)]
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda a: _post(client, url, a[1][0], a[1][1], a[0]),
                                  enumerate(warm)))
        assert codes == [200] * WARMUP
        rng = random.Random(0)
        mixed = [(rng.randint(*LENGTHS), rng.randint(*MAX_TOKENS)) for _ in range(500)]
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda a: _post(client, url, a[1][0], a[1][1], 1000 + a[0]),
                                  enumerate(mixed)))
        assert codes == [200] * 500
        text = client.get(url + "/metrics").text
        steps = [r for r in client.get(url + "/debug/timeline", params={"limit": 50}).json()[
            "records"] if r["kind"] == "step"]

    memory = steps[-1]["memory"]
    assert memory["steady_baseline_bytes"] > 0  # the baseline was taken after warm-up
    growth = metric_value(text, "tailserve:steady_memory_growth_bytes")
    assert growth is not None and growth < TOLERANCE_MIB * MIB, memory
    assert memory["steady_growth_bytes"] < TOLERANCE_MIB * MIB, memory
    assert metric_value(text, "tailserve:steady_memory_violations_total") == 0
    assert "steady memory:" not in server.output()
