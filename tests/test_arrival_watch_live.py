"""A live server with the bundled model, its default SLOs and the official ``openai`` client
sending one long prompt after another (a closed loop): nobody arrives while the engine works,
so the cap on steps without decodes grows past the ITL SLO's (``prefill_step_cap_by`` turns
``arrivals`` in the timeline) and the later prompts take fewer steps; then prompts that arrive
while one is prefilled raise the busy-arrival rate again. Step counts, not times: on a slower
host the caps scale with the step-time model and the work accrues sooner, so the order holds."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from server_util import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PROMPT_TOKENS = 900


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "2048"]) as srv:
        yield srv


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]


def _steps_of(client: openai.OpenAI, prompt: list[int]) -> int:
    """The engine steps with prefill of one completion (its tailserve_timing)."""
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    timing: dict[str, Any] = (out.model_extra or {})["tailserve_timing"]
    return int(timing["num_steps_with_prefill"])


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"tailserve:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"tailserve:{name} not on /metrics")


def test_a_closed_loop_gets_longer_steps_and_arrivals_take_them_back(
        server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    rng = random.Random(7)
    steps = [_steps_of(client, _prompt(rng)) for _ in range(30)]
    # Cold, the watch assumes an arrival a second: ~100 ms steps (a 900-token prompt in 5
    # on two cores here); after ~10 s of work with nobody arriving, whole-budget ones (2 for
    # 900 tokens in the default 512-token budget; measured: 5 x 9, 4, 3 x 4, then 2).
    assert steps[-1] == 2 and steps[-1] <= min(steps[:2]), steps
    records = httpx.get(server.url + "/debug/timeline", params={"since": 0}).json()["records"]
    caps = [r["prefill_step_cap_by"] for r in records if r["kind"] == "step"]
    assert caps[-1] == "arrivals" and {"itl_slo", "fixed_cost"} & set(caps), caps[-5:]
    quiet = _gauge(server.url, "busy_arrival_rate")
    assert quiet < 0.5
    # Open loop: three prompts sent while a fourth is being prefilled found the engine busy.
    done = threading.Event()

    def long_one() -> None:
        _steps_of(client, _prompt(random.Random(8)) * 2)
        done.set()

    t = threading.Thread(target=long_one)
    t.start()
    time.sleep(0.1)  # it is in the engine: the short ones arrive while it is prefilled
    for k in range(3):
        _steps_of(client, _prompt(random.Random(20 + k))[:64])
    t.join(timeout=60)
    assert done.is_set()
    assert _gauge(server.url, "busy_arrival_rate") > quiet
