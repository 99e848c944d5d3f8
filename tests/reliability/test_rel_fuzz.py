"""schemathesis over every operation: >= 10,000 cases, 0 server errors, 0 client timeouts.

Positive and negative cases from the published /openapi.json, and "served" cases within the
ranges the server enforces (so they reach the engine, streaming and n > 1 among them). The
server's max_model_len 128 bounds every generation, so no case may take long: each call has a
10 s client timeout, and a timeout fails the run like a 5xx does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from server_util import ServerProcess, metric_value
from test_server_errors import (
    ENV_AUTH,
    ENV_KEY,
    FUZZ_OPERATIONS,
    GENERATES,
    WITH_INPUT,
    check_error_body,
    served_ranges,
)

TOTAL_CASES = 10_000
# Operations without inputs (GET /health, ...) have one or two distinct cases, and hypothesis
# stops there; the quotas aim above the total so the sum still reaches it.
QUOTA_TOTAL = 11_500
CLIENT_TIMEOUT_S = 10.0
# The generation operations get most of the cases: that is where the engine is reached.
WEIGHTS = {("POST", "/v1/completions"): 6, ("POST", "/v1/chat/completions"): 6}
CASES = [
    (method, path, mode)
    for method, path in FUZZ_OPERATIONS
    for mode in ("positive", "negative", "served")
    if mode == "positive"
    or (mode == "negative" and path in WITH_INPUT)
    or (mode == "served" and path in GENERATES)
]
_WEIGHT_SUM = sum(WEIGHTS.get((m, p), 1) for m, p, _ in CASES)


def examples_for(method: str, path: str) -> int:
    return -(-QUOTA_TOTAL * WEIGHTS.get((method, path), 1) // _WEIGHT_SUM)  # ceiling


_COUNTS: dict[str, int] = {"cases": 0, "server_errors": 0, "timeouts": 0}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "128"], model=tiny_model_dir,
                       env={"TAILSERVE_API_KEY": ENV_KEY}) as srv:
        yield srv


@pytest.fixture(scope="module")
def schemas(fuzz_server: ServerProcess, tiny_model_dir: str) -> dict[str, Any]:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    models = httpx.get(fuzz_server.url + "/v1/models", headers=ENV_AUTH, timeout=10).json()
    raw = httpx.get(fuzz_server.url + "/openapi.json", headers=ENV_AUTH, timeout=10).json()
    return {
        "published": schemathesis.openapi.from_dict(raw),
        "served": schemathesis.openapi.from_dict(
            served_ranges(raw, models["data"][0]["id"], vocab_size)
        ),
    }


@pytest.mark.parametrize(("method", "path", "mode"), [
    pytest.param(*c, id=f"{c[0]} {c[1]} {c[2]}") for c in CASES
])
def test_fuzz(
    fuzz_server: ServerProcess, schemas: dict[str, Any], method: str, path: str, mode: str
) -> None:
    schema = schemas["served" if mode == "served" else "published"]
    operation = schema[path][method]
    generation_mode = GenerationMode.NEGATIVE if mode == "negative" else GenerationMode.POSITIVE

    @given(case=operation.as_strategy(generation_mode=generation_mode))
    @settings(max_examples=examples_for(method, path), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        _COUNTS["cases"] += 1
        try:
            response = case.call(base_url=fuzz_server.url, headers=ENV_AUTH,
                                 timeout=CLIENT_TIMEOUT_S)
        except Exception as exc:  # a timeout or a dropped connection: both count as failures
            _COUNTS["timeouts"] += 1
            raise AssertionError(f"no answer within {CLIENT_TIMEOUT_S} s: {exc!r}") from None
        if response.status_code >= 500:
            _COUNTS["server_errors"] += 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code != 401, response.text
        if response.status_code >= 400:
            check_error_body(response.text)

    run()


def test_fuzz_totals(fuzz_server: ServerProcess, figures: dict[str, Any]) -> None:
    """Runs after the cases (file order): at least TOTAL_CASES ran, none failed, and the
    server is idle and healthy with nothing in its log but warnings."""
    figures.update(_COUNTS)
    assert _COUNTS["cases"] >= TOTAL_CASES, _COUNTS
    assert _COUNTS["server_errors"] == 0 and _COUNTS["timeouts"] == 0, _COUNTS
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(fuzz_server.url + "/metrics", timeout=10).text
    assert metric_value(metrics, "tailserve:num_requests_running") == 0
    assert metric_value(metrics, "tailserve:num_requests_waiting") == 0
    assert "Traceback" not in fuzz_server.output()
