"""Goodput and capacity: the SLO verdict of one request and a step's goodput worked out by hand,
where the SLOs come from (flags, vLLM's --goodput, the server's gauges), the capacity search
on a fake server (a function rate -> attainment) with its exact path, and one short sweep
against the real server with the bundled model."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from server_util import ServerProcess
from tailserve.bench import BenchError
from tailserve.bench.capacity import (
    Point,
    SearchOptions,
    bracket,
    capacities,
    next_rate,
    search,
    step_points,
)
from tailserve.bench.client import RequestResult
from tailserve.bench.goodput import SloSpec, judge, published_slos, resolve_slos
from tailserve.bench.metrics import compute_metrics, step_goodput
from tailserve.bench.observe import parse_metrics


def req(i: int, ttft: float | None, gaps: list[float], out: int | None,
        e2el: float | None, error: str | None = None) -> RequestResult:
    return RequestResult(i, f"r{i}", 10, 16, 0.0, send_s=0.0, ttft_s=ttft, itl_s=gaps,
                         output_tokens=out, e2el_s=e2el, error_type=error)


def runs() -> list[RequestResult]:
    return [
        # 0: TTFT 0.5 s, worst gap 0.1 s, TPOT (1.4 - 0.5) / 9 = 0.1 s
        req(0, 0.5, [0.1] * 9, 10, 1.4),
        # 1: TTFT exactly at 1 s; one gap of 0.3 s, TPOT (1.5 - 1.0) / 5 = 0.1 s
        req(1, 1.0, [0.05, 0.3, 0.05, 0.05, 0.05], 6, 1.5),
        # 2: TTFT 1.2 s (missed); gaps 0.05 s, TPOT 0.05 s
        req(2, 1.2, [0.05] * 4, 5, 1.4),
        # 3: one token: no gap, TPOT 0
        req(3, 0.2, [], 1, 0.2),
        # 4: failed
        req(4, None, [], None, None, error="timeout"),
    ]


SLOS = SloSpec(ttft_ms=1000.0, itl_ms=200.0, tpot_ms=100.0)


def test_each_request_against_each_slo() -> None:
    v = [judge(SLOS, r.success, r.ttft_s, r.itl_s, r.output_tokens, r.e2el_s) for r in runs()]
    assert [(x.ttft, x.itl, x.tpot) for x in v] == [
        (True, True, True), (True, False, True), (False, True, True), (True, True, True),
        (False, False, False)]
    assert [x.good for x in v] == [True, False, False, True, False]
    assert [x.missed for x in v] == [[], ["itl"], ["ttft"], [], ["failed"]]
    # An SLO not given is not judged; TPOT is the mean gap, ITL the worst one.
    only_tpot = judge(SloSpec(tpot_ms=100.0), True, 1.0, [0.05, 0.3, 0.05, 0.05, 0.05], 6, 1.5)
    assert (only_tpot.ttft, only_tpot.itl, only_tpot.tpot, only_tpot.good) == (
        None, None, True, True)
    assert not judge(SloSpec(tpot_ms=99.0), True, 1.0, [0.1], 6, 1.5).good


def test_step_goodput_share_and_rate() -> None:
    g = step_goodput(runs(), SLOS, duration_s=4.0)
    assert (g.num_sent, g.num_good, g.num_failed) == (5, 2, 1)
    assert g.share == pytest.approx(0.4) and g.rate == pytest.approx(0.5)
    assert g.missed == {"ttft": 1, "itl": 1, "tpot": 0}
    j = g.as_json()
    assert (j["ttft_ms"], j["itl_ms"], j["tpot_ms"], j["e2el_ms"]) == (1000.0, 200.0, 100.0, None)
    assert j["source"] == "client" and j["goodput_share"] == pytest.approx(0.4)
    # vLLM's key agrees: good requests over the duration.
    assert compute_metrics(runs(), 4.0, [99], SLOS)["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(runs(), 4.0, [99], {"itl": 250.0})["request_goodput"] == \
        pytest.approx(3 / 4)  # 0, 2, 3 (request 1's 0.3 s gap misses)
    assert step_goodput([], SLOS, 1.0).share is None


def test_slos_come_from_the_client_first_then_the_server() -> None:
    server = {"ttft": 2000.0, "itl": 150.0}
    s = resolve_slos(500.0, None, None, None, server)
    assert (s.ttft_ms, s.itl_ms, s.source) == (500.0, None, "client")
    s = resolve_slos(None, None, 40.0, {"ttft": 800.0}, server)
    assert (s.ttft_ms, s.tpot_ms, s.source) == (800.0, 40.0, "client")
    s = resolve_slos(None, None, None, None, server)
    assert (s.ttft_ms, s.itl_ms, s.tpot_ms, s.source) == (2000.0, 150.0, None, "server")
    assert not resolve_slos(None, None, None, None, {})
    assert resolve_slos(500.0, None, None, {"ttft": 500.0}).ttft_ms == 500.0  # agree: fine
    with pytest.raises(BenchError, match="--slo-ttft-ms 500 and --goodput ttft:400 disagree"):
        resolve_slos(500.0, None, None, {"ttft": 400.0})
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(BenchError, match="--slo-itl-ms must be a positive"):
            resolve_slos(None, bad, None, None)


def test_published_slos_from_the_metrics_page() -> None:
    page = "\n".join([
        "# HELP tailserve:slo_ttft_seconds the default TTFT SLO",
        "# TYPE tailserve:slo_ttft_seconds gauge",
        'tailserve:slo_ttft_seconds{model_name="m"} 1.5',
        "tailserve:slo_itl_seconds 0.1",
        'tailserve:slo_missed_total{slo="itl",priority="0"} 3.0',
        "tailserve:min_decode_slack_seconds 0.02",
    ])
    samples = parse_metrics(page)
    assert samples['tailserve:slo_missed_total{slo="itl",priority="0"}'] == 3.0
    # A labelled gauge is found by its name alone; a gauge at 0 is an unset SLO.
    assert published_slos({"tailserve:slo_ttft_seconds": 1.5,
                           "tailserve:slo_itl_seconds": 0.1}) == {"ttft": 1500.0, "itl": 100.0}
    assert published_slos(samples) == {"ttft": 1500.0, "itl": 100.0}
    assert published_slos({"tailserve:slo_ttft_seconds": 0.0}) == {}


# ------------------------------------------------------------------ the capacity search
def stepped(rate: float) -> float:
    """A fake server: everyone meets the SLOs up to 3 req/s, 95% up to 4, nobody beyond."""
    return 1.0 if rate <= 3.0 else 0.95 if rate <= 4.0 else 0.0


def test_search_path_ladder_then_bisection_for_each_target() -> None:
    points, caps = search(stepped, 2.0, SearchOptions(max_steps=12))
    r2 = math.sqrt(2.0)
    # 90%: up the ladder 2 -> 4 -> 8 (missed), bisect [4, 8] at geometric means until
    # 8 / 4 is within 10%; then 99%: bracket [2, 4] from the same points, bisected.
    expected = [2.0, 4.0, 8.0, 4 * r2, 4 * 2 ** 0.25, 4 * 2 ** 0.125,
                2 * r2, 2 * r2 * (4 / (2 * r2)) ** 0.5]
    expected.append(math.sqrt(2 * r2 * expected[-1]))
    assert [p.rate for p in points] == pytest.approx(expected)
    c90, c99 = caps
    assert (c90.target, c90.rate, c90.resolved) == (0.9, 4.0, True)
    assert c90.missed_at == pytest.approx(4 * 2 ** 0.125)
    assert c99.rate == pytest.approx(2 * r2) and c99.missed_at == pytest.approx(expected[-1])
    assert c99.resolved and c99.missed_at / c99.rate <= 1.1


def test_search_is_bounded_and_says_when_unresolved() -> None:
    points, caps = search(stepped, 2.0)  # the default: at most 8 rates
    assert len(points) == 8
    assert caps[0].resolved and not caps[1].resolved
    assert caps[1].rate == pytest.approx(2 * math.sqrt(2.0))  # still a rate measured to meet
    # Nothing meets it: the ladder descends to min_rate and stops with no capacity.
    points, caps = search(lambda r: 0.5, 1.0, SearchOptions(min_rate=0.1, max_steps=20))
    assert [p.rate for p in points] == [1.0, 0.5, 0.25, 0.125]
    assert all(c.rate is None and c.missed_at == 0.125 for c in caps)
    # A failed run (None) counts as a miss.
    assert bracket([Point(1.0, None), Point(0.5, 1.0)], 0.9, 0.1).missed_at == 1.0


def test_a_lucky_rate_above_a_miss_does_not_raise_the_capacity() -> None:
    points = [Point(2.0, 1.0), Point(4.0, 0.5), Point(8.0, 0.95), Point(2.2, 0.95)]
    c = bracket(points, 0.9, 0.1)
    assert (c.rate, c.missed_at, c.resolved) == (2.2, 4.0, False)
    assert next_rate(points, 2.0) == pytest.approx(math.sqrt(2.2 * 4.0))
    assert next_rate([], 3.0) == 3.0
    with pytest.raises(ValueError, match="finite start rate"):
        next_rate([], math.inf)
    with pytest.raises(ValueError, match="--sweep-max-steps"):
        SearchOptions(max_steps=0)


def test_sweep_points_from_step_results() -> None:
    steps = [{"request_rate": "inf", "tailserve": {"goodput": {"goodput_share": 0.1}}},
             {"request_rate": 2.0, "tailserve": {"goodput": {"goodput_share": 1.0}}},
             {"request_rate": 4.0, "tailserve": {"goodput": None}}]
    assert step_points(steps) == [Point(2.0, 1.0)]


# ------------------------------------------------------------------ live: the bundled model
@pytest.fixture(scope="module")
def bundled() -> Iterator[ServerProcess]:
    with ServerProcess(["--max-num-seqs", "8", "--max-model-len", "512"]) as srv:
        yield srv


def test_live_sweep_finds_capacity_on_the_bundled_model(bundled: ServerProcess,
                                                        tmp_path: Path) -> None:
    from tailserve.bench.config import BenchConfig
    from tailserve.bench.datasets import DatasetOptions
    from tailserve.bench.run import run_bench

    path = tmp_path / "sweep.json"
    cfg = BenchConfig(base_url=bundled.url, sweep=True, sweep_max_steps=3, observe=False,
                      progress=False, save_result=str(path), slo_ttft_ms=60000.0,
                      slo_itl_ms=60000.0,
                      dataset=DatasetOptions(num_prompts=4, input_len=16, output_len=4))
    out = io.StringIO()
    steps = run_bench(cfg, Console(file=out, width=140))
    names = [s["tailserve"]["step"]["name"] for s in steps]
    assert names[0] == "throughput" and len(steps) == 4  # the throughput step + 3 rates
    peak = steps[0]["request_throughput"]
    # SLOs no run can miss: every rate meets both targets, so the ladder climbs from half
    # the throughput step's rate, doubling, until the steps run out.
    assert [s["request_rate"] for s in steps[1:]] == pytest.approx([peak / 2, peak, 2 * peak])
    for s in steps:
        g = s["tailserve"]["goodput"]
        assert (g["ttft_ms"], g["itl_ms"], g["source"]) == (60000.0, 60000.0, "client")
        assert g["goodput_share"] == 1.0 and g["num_good"] == 4 == g["num_sent"]
        assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    summary = json.loads(path.read_text())
    caps = summary["capacity"]["targets"]
    assert [c["target"] for c in caps] == [0.9, 0.99]
    for c in caps:
        assert c["capacity_req_s"] == pytest.approx(2 * peak)
        assert c["lowest_missing_rate"] is None and c["resolved"] is False
    assert [p["rate"] for p in summary["capacity"]["points"]] == pytest.approx(
        [peak / 2, peak, 2 * peak])
    assert [r["goodput_share"] for r in summary["steps"]] == [1.0] * 4
    text = out.getvalue()
    assert "capacity at >= 90% meeting TTFT <= 60000 ms and every gap <= 60000 ms" in text
    assert "no rate tried missed it (a lower bound)" in text
    assert capacities([Point(1.0, 1.0)])[0].rate == 1.0


def test_bench_judges_by_the_servers_published_slos(tmp_path: Path) -> None:
    """A server that publishes its default SLOs on /metrics (and no client SLO): every step
    reports goodput against them; a 300 ms gap misses the 50 ms ITL SLO."""
    from aiohttp import web

    from tailserve.cli import main
    from test_bench import DONE, FakeServer, cmpl_chunk, sse

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="tailserve:slo_ttft_seconds 0.5\n"
                            'tailserve:slo_itl_seconds{model_name="m"} 0.05\n')

    stream = sse([cmpl_chunk("a"), 0.3, cmpl_chunk("b", "length"), DONE])
    path = tmp_path / "r.json"
    with FakeServer({("GET", "/v1/models"): models, ("GET", "/metrics"): metrics,
                     ("POST", "/v1/completions"): stream}) as srv:
        assert main(["bench", "--base-url", srv.url, "--num-prompts", "3", "--input-len", "8",
                     "--no-progress", "--no-observe", "--save-result", str(path)]) == 0
        g = json.loads(path.read_text())["tailserve"]["goodput"]
        assert (g["source"], g["ttft_ms"], g["itl_ms"], g["tpot_ms"]) == (
            "server", 500.0, 50.0, None)
        assert (g["num_sent"], g["num_good"], g["missed"]) == (3, 0, {"ttft": 0, "itl": 3})
        # The client's own SLO wins: a 1 s ITL SLO, and the server's TTFT is not used.
        assert main(["bench", "--base-url", srv.url, "--num-prompts", "3", "--input-len", "8",
                     "--no-progress", "--no-observe", "--save-result", str(path),
                     "--slo-itl-ms", "1000"]) == 0
        g = json.loads(path.read_text())["tailserve"]["goodput"]
        assert (g["source"], g["ttft_ms"], g["itl_ms"], g["goodput_share"]) == (
            "client", None, 1000.0, 1.0)
        # --no-server-slos: no SLO at all, no goodput.
        assert main(["bench", "--base-url", srv.url, "--num-prompts", "3", "--input-len", "8",
                     "--no-progress", "--no-observe", "--save-result", str(path),
                     "--no-server-slos"]) == 0
        assert json.loads(path.read_text())["tailserve"]["goodput"] is None
