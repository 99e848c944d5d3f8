"""``tailserve bench --replica`` through vllm-router, live: two real replicas
(deploy/router/serve_replicas.py, round_robin), replica 1 made slow by fault injection
(``fault_env(slow_step_ms=300)``: every step 300 ms longer, at the same batch).

* Through the router: every request is attributed to the replica that served it (by its
  x-request-id on the replica timelines), round_robin splits them evenly, and diagnose names
  ``slow_replica`` for replica 1 as the top cause of the TTFT and ITL tails.
* The bench sent straight at replica 0 with both listed (what a client that bypasses the
  router, or a router with everything pinned to one worker, does): all requests on replica 0,
  and the TTFT tail is ``router_imbalance`` on replica 0 while replica 1 idled.

Skips, with the reason, only where the vllm-router executable is missing or cannot run.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from fault_site.fault_injection import fault_env
from tailserve.analyze.data import run_from_result
from tailserve.analyze.diagnose import diagnose
from tailserve.bench.config import BenchConfig, DatasetOptions
from tailserve.bench.run import run_bench
from test_router_replicas import start_cluster

SERVE_ARGS = ["--num-kv-blocks", "64", "--block-size", "16", "--max-model-len", "128",
              "--max-num-seqs", "4", "--log-level", "warning"]
SLOW_MS = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with start_cluster(tmp_path_factory.mktemp("replicas"), SERVE_ARGS,
                       ["--policy", "round_robin",
                        *[f"--replica-env=1:{name}={value}"
                          for name, value in fault_env(slow_step_ms=SLOW_MS).items()]]) as state:
        yield state


def bench(base_url: str, replicas: list[str], rate: float, warmup: int) -> dict[str, Any]:
    # Two warm-up requests: round_robin gives each replica one, so neither pays its first
    # forward's one-off costs inside the measured run.
    cfg = BenchConfig(base_url=base_url, replicas=replicas, request_rate=rate, seed=3,
                      warmup=warmup, tokenizer="default", progress=False, metrics_interval_s=0.5,
                      dataset=DatasetOptions(num_prompts=12, input_len=32, output_len=8))
    [step] = run_bench(cfg, Console(file=io.StringIO(), width=140))
    assert step["completed"] == 12, step["tailserve"]["warnings"]
    return step


def test_slow_replica_and_router_imbalance(cluster: dict[str, Any]) -> None:
    urls = [r["url"] for r in cluster["replicas"]]
    step = bench(cluster["router_url"], urls, rate=3.0, warmup=2)
    ts = step["tailserve"]
    assert ts["replica_attribution"]["matched"] == 12
    assert sorted(q["replica"] for q in ts["requests"]) == [0] * 6 + [1] * 6  # round_robin
    assert [o["url"] for o in ts["replicas"]] == urls
    for o in ts["replicas"]:
        assert o["num_requests"] == 6
        assert {h["status"] for h in o["health"]} == {200}
        assert {s["phase"] for s in o["metric_samples"]} >= {"before", "during", "after"}
    assert "server" not in ts  # the router forwards /metrics to some worker: not observed
    # The tail above P90: with 12 requests a P99 tail is one sample, and on a shared 2-core
    # host one CPU-contention stall on the fast replica could be that one.
    d = diagnose(run_from_result(step), percentile=90)
    assert d.replicas is not None and d.replicas[1]["slowness"] > 1.5, d.replicas
    for m in ("ttft", "itl"):
        top = d.tails[m].causes[0]
        assert (top.cause, top.evidence.get("replica")) == ("slow_replica", urls[1]), \
            (m, [(c.cause, round(c.share, 3)) for c in d.tails[m].causes], d.replicas)

    step = bench(urls[0], urls, rate=float("inf"), warmup=0)  # both warm by now
    assert [o["num_requests"] for o in step["tailserve"]["replicas"]] == [12, 0]
    d = diagnose(run_from_result(step), percentile=90)
    top = d.tails["ttft"].causes[0]
    assert (top.cause, top.evidence.get("replica")) == ("router_imbalance", urls[0]), \
        [(c.cause, round(c.share, 3)) for c in d.tails["ttft"].causes]
    assert top.evidence["requests_per_replica"] == [12, 0]
