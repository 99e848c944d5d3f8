"""Runs through a router (bench --replica): which replica served each request, and diagnose's
two replica causes on constructed runs (two simulated engines joined into one result, the
shape bench writes), with a balanced pair of equal replicas as the control."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diagnose_sim import T0, Sim, simulate
from tailserve.analyze.data import Steps, run_from_result
from tailserve.analyze.diagnose import diagnose
from tailserve.analyze.replicas import free_elsewhere, joined_run, queued_at
from tailserve.bench.replicas import attribute_requests, replicas_block
from tailserve.cli import main

URLS = ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]


def test_attribution_by_request_id() -> None:
    r0 = [{"kind": "request", "request_id": "a", "t": 1.0},
          {"kind": "step", "t": 1.5},
          {"kind": "request", "request_id": "c", "t": 2.0}]
    r1 = [{"kind": "request", "request_id": "b", "t": 1.2},
          # a retry: the router tried replica 1 after replica 0 failed it; 1 answered last
          {"kind": "request", "request_id": "c", "t": 3.0},
          {"kind": "request", "request_id": None, "t": 3.5}]
    att = attribute_requests(["a", "b", "c", "d"], [r0, r1, None])
    assert att.replica == [0, 1, 1, None]
    assert (att.matched, att.unmatched, att.ambiguous) == (3, 1, 1)


def test_replicas_block_marks_each_record() -> None:
    from tailserve.bench.replicas import ReplicaInfo

    infos = [ReplicaInfo(URLS[0], True, True), ReplicaInfo(URLS[1], True, True)]
    obs = [{"metric_samples": [], "timeline": [{"kind": "request", "request_id": "x", "t": 1}]},
           {"metric_samples": [], "timeline": [{"kind": "request", "request_id": "y", "t": 1}]}]
    reqs: list[dict[str, Any]] = [{"request_id": "y"}, {"request_id": "x"},
                                  {"request_id": "z"}]
    block = replicas_block(infos, obs, reqs)
    assert [r["replica"] for r in reqs] == [1, 0, None]
    assert [b["num_requests"] for b in block["replicas"]] == [1, 1]
    assert [b["url"] for b in block["replicas"]] == URLS
    assert block["replica_attribution"]["unmatched"] == 1


def _steps(t: list[float], waiting: list[int]) -> Steps:
    n = len(t)
    z = np.zeros(n)
    return Steps(t=np.array(t), step_s=np.full(n, 0.1), prefill=z, decode=z, running=z,
                 waiting=np.array(waiting, dtype=float), free_blocks=z, total_blocks=z,
                 preemptions=z, blocked_by=[None] * n, rss=z)


def test_queued_at_and_free_elsewhere() -> None:
    st = _steps([1.0, 2.0, 3.0], [0, 2, 0])
    # (1, 2] is the step that recorded 2 waiting; before the first step and after the last
    # the replica ran nothing: no queue.
    got = queued_at(st, np.array([0.5, 1.0, 1.5, 2.0, 2.5, 3.5]))
    assert got.tolist() == [False, False, True, True, False, False]

    class R:
        def __init__(self, index: int, steps: Steps | None, healthy: bool = True) -> None:
            self.index, self.healthy = index, healthy
            self.run = type("Run", (), {"steps": steps})()

    busy = _steps([1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1])  # queued over (1, 4]
    reps: Any = [R(0, busy), R(1, st)]
    # Replica 0 asks: replica 1 is queued over (1, 2] only; before 1 replica 0 itself had
    # no queue (the wait for a step to end is no imbalance).
    frac = free_elsewhere(reps, 0, np.array([1.0, 0.0, 1.0, 2.0]),
                          np.array([2.0, 1.0, 3.0, 4.0]))
    assert frac.tolist() == [0.0, 0.0, 0.5, 1.0]
    # Replica 1 asks over (1, 2], its queued step: replica 0 was queued too ...
    assert free_elsewhere(reps, 1, np.array([1.0]), np.array([2.0])).tolist() == [0.0]
    # ... an idle replica 0 (no steps) always had room ...
    reps[0] = R(0, None)
    assert free_elsewhere(reps, 1, np.array([1.0]), np.array([2.0])).tolist() == [1.0]
    # ... unless it was unhealthy (the router could not have sent anything there).
    reps[0].healthy = False
    assert free_elsewhere(reps, 1, np.array([1.0]), np.array([2.0])).tolist() == [0.0]


def join(sims: list[Sim], health: list[list[int]] | None = None) -> dict[str, Any]:
    """Two simulated engines as one bench result through a router: each replica's requests
    renamed apart, sent at the simulated times, each replica's timeline observed."""
    results = [simulate(s) for s in sims]
    records, observed = [], []
    for k, res in enumerate(results):
        ts = res["tailserve"]
        rename = {q["request_id"]: f"bench-sim-0-r{k}-{q['index']}" for q in ts["requests"]}
        for q in ts["requests"]:
            records.append({**q, "request_id": rename[q["request_id"]]})
        timeline = [{**r, "request_id": rename[r["request_id"]]} if r["kind"] == "request"
                    else r for r in ts["server"]["timeline"]]
        codes = (health or [[200, 200]] * len(sims))[k]
        observed.append({"metric_samples": [], "errors": [], "timeline": timeline,
                         "health": [{"t": T0 + i, "phase": "during", "status": c}
                                    for i, c in enumerate(codes)]})
    records.sort(key=lambda q: q["send_s"])
    for i, q in enumerate(records):
        q["index"] = i
    from tailserve.bench.replicas import ReplicaInfo

    out = dict(results[0])
    ts = {k: v for k, v in results[0]["tailserve"].items() if k != "server"}
    ts["requests"] = records
    ts |= replicas_block([ReplicaInfo(u, True, True) for u in URLS[:len(sims)]], observed,
                         records)
    out["tailserve"] = ts
    out["duration"] = max(r["duration"] for r in results)
    out["num_prompts"] = len(records)
    return out


# The same engine cost, one replica 3x slower at every batch (a slower host), equal traffic.
SLOW = [Sim(n=120, rate=8, seed=11),
        Sim(n=120, rate=8, base_s=0.030, per_decode_s=0.0012, per_prefill_s=0.00006, seed=12)]
# One replica gets nearly everything (queues: 4 slots, ~14 req/s capacity), the other 3.
IMBALANCED = [Sim(n=200, rate=40, max_num_seqs=4, seed=13), Sim(n=3, rate=0.3, seed=14)]
BALANCED = [Sim(n=100, rate=5, seed=15), Sim(n=100, rate=5, seed=16)]


def causes(d: Any, metric: str) -> dict[str, float]:
    return {c.cause: c.share for c in d.tails[metric].causes}


def test_slow_replica_named_with_its_url() -> None:
    d = diagnose(run_from_result(join(SLOW)))
    assert [r["num_requests"] for r in d.replicas or []] == [120, 120]
    slow = [r["slowness"] for r in d.replicas or []]
    assert slow[1] == pytest.approx(3.0, rel=0.1) and slow[0] == pytest.approx(1 / 3, rel=0.1)
    # (E2EL's P99 is within 2x its median here: ``none``, by the rule every run gets.)
    for m in ("ttft", "itl"):
        top = d.tails[m].causes[0]
        assert top.cause == "slow_replica", (m, causes(d, m))
        assert top.evidence["replica"] == URLS[1]
        assert top.evidence["tail_share_from_replica"] == 1.0
        assert top.evidence["sample_share_from_replica"] == pytest.approx(0.5, abs=0.02)
    assert "router_imbalance" not in causes(d, "ttft")
    assert any(f.startswith("slow_replica: http://127.0.0.1:9101") for f in d.findings)


def test_router_imbalance_named_with_the_loaded_replica() -> None:
    d = diagnose(run_from_result(join(IMBALANCED)))
    assert [r["num_requests"] for r in d.replicas or []] == [200, 3]
    shares = causes(d, "ttft")
    assert d.tails["ttft"].causes[0].cause == "router_imbalance", shares
    top = d.tails["ttft"].causes[0]
    assert top.evidence["replica"] == URLS[0]
    assert top.evidence["requests_per_replica"] == [200, 3]
    assert shares["router_imbalance"] > 3 * shares.get("queueing", 0.0)
    assert "slow_replica" not in shares


def test_unhealthy_peer_is_no_imbalance() -> None:
    # The same run, but replica 1 failed its /health: the router was right to avoid it, and
    # the wait on replica 0 is plain queueing.
    d = diagnose(run_from_result(join(IMBALANCED, health=[[200, 200], [200, 503]])))
    shares = causes(d, "ttft")
    assert d.tails["ttft"].causes[0].cause == "queueing", shares
    assert "router_imbalance" not in shares
    assert d.replicas is not None and d.replicas[1]["healthy"] is False


def test_balanced_equal_replicas_name_neither() -> None:
    d = diagnose(run_from_result(join(BALANCED)))
    slow = [r["slowness"] for r in d.replicas or []]
    assert all(s == pytest.approx(1.0, abs=0.1) for s in slow), slow
    for m, t in d.tails.items():
        named = {c.cause for c in t.causes}
        assert not named & {"slow_replica", "router_imbalance"}, (m, named)


def test_request_replica_recomputed_when_missing() -> None:
    res = join(SLOW)
    for q in res["tailserve"]["requests"]:
        del q["replica"]
    run = joined_run(res)
    assert run.replicas is not None
    assert [len(r.run.requests) for r in run.replicas] == [120, 120]


def test_cli_json_html_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(join(SLOW)))
    html = tmp_path / "r.html"
    assert main(["diagnose", str(path), "--json", "--html", str(html)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["url"] for r in out["replicas"]] == URLS
    assert out["tail"]["ttft"]["causes"][0]["cause"] == "slow_replica"
    page = html.read_text()
    assert "slow_replica" in page and "<h2>Replicas</h2>" in page and URLS[1] in page
    assert main(["compare", str(path), str(path)]) == 0


def test_replica_flag() -> None:
    from tailserve.cli import bench_config_from, build_parser

    ns = build_parser().parse_args(["bench", "--replica", URLS[0], "--replica", URLS[1]])
    assert bench_config_from(ns, argv=[]).replicas == URLS
    assert bench_config_from(build_parser().parse_args(["bench"]), argv=[]).replicas == []
    with pytest.raises(SystemExit):  # tune starts its own server: no replicas to observe
        build_parser().parse_args(["tune", "--replica", URLS[0]])


def test_replica_mistakes_are_said_before_any_load() -> None:
    from server_util import free_port
    from tailserve.bench import BenchError
    from tailserve.bench.config import BenchConfig
    from tailserve.bench.replicas import probe_replicas
    from tailserve.bench.run import run_bench

    with pytest.raises(BenchError, match="--base-url-b"):
        run_bench(BenchConfig(replicas=URLS, base_url_b=URLS[1]))
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchError, match="connection refused"):
        probe_replicas([dead], {})
    with pytest.raises(BenchError, match="given twice"):
        probe_replicas([dead + "/v1", dead], {})
