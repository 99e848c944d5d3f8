"""tailserve tune: goodput share, the Pareto front and the recommendation worked out by hand on
small grids, the HTML page, the CLI's usage errors, and one live run of two settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tailserve.analyze.sweep import step_goodput_share
from tailserve.analyze.tradeoff import (
    Slos,
    goodput_front,
    goodput_share,
    pareto_front,
    recommend,
    request_is_good,
    slo_ratio,
)
from tailserve.analyze.tune import analyze_rows
from tailserve.analyze.tune_report import render_tune_html
from tailserve.cli import main
from tailserve.errors import ConfigError

SLOS = Slos(ttft_ms=1000.0, itl_ms=100.0)


def row(ttft: float, itl: float, good: float | None = 1.0, tput: float = 10.0,
        **more: Any) -> dict[str, Any]:
    return {"completed": 10, "failed": 0, "p99_ttft_ms": ttft, "p99_itl_ms": itl,
            "goodput_share": good, "output_throughput": tput, **more}


def test_a_request_is_good_at_the_slo_and_not_past_it() -> None:
    assert request_is_good(1.0, [0.1, 0.05], True, SLOS)  # both exactly at the SLO
    assert not request_is_good(1.0001, [0.01], True, SLOS)
    assert not request_is_good(0.5, [0.01, 0.1001], True, SLOS)  # one stall is enough
    assert not request_is_good(0.5, [0.01], False, SLOS)  # failed
    assert not request_is_good(None, [], True, SLOS)  # no first token
    assert request_is_good(0.2, [], True, SLOS)  # one token: no gap to judge


def test_goodput_share_counts_failures_against_the_requests_sent() -> None:
    ttfts = [0.2, 0.3, 1.5, None, 0.4]
    itls = [[0.01, 0.02], [0.2], [0.01], [], [0.05]]
    ok = [True, True, True, False, True]
    assert goodput_share(ttfts, itls, ok, SLOS) == pytest.approx(2 / 5)
    assert goodput_share([], [], [], SLOS) is None
    with pytest.raises(ValueError, match="differ in length"):
        goodput_share([0.1], [], [True], SLOS)


def test_step_goodput_share_reads_bench_records() -> None:
    step = {"tailserve": {"requests": [
        {"ttft_s": 0.5, "itl_s": [0.05], "error_type": None, "send_s": 0.0},
        {"ttft_s": 0.5, "itl_s": [0.5], "error_type": None, "send_s": 0.1},
        {"ttft_s": None, "itl_s": [], "error_type": "http", "send_s": 0.2},
        {"ttft_s": None, "itl_s": [], "error_type": None, "send_s": None},  # never sent
    ]}}
    assert step_goodput_share(step, SLOS) == pytest.approx(1 / 4)


def test_pareto_front_exact() -> None:
    rows = [
        row(500, 300),  # 0: front (lowest TTFT)
        row(800, 200),  # 1: front
        row(900, 250),  # 2: dominated by 1
        row(800, 200),  # 3: equal to 1: neither dominates, both on the front
        row(1500, 50),  # 4: front (lowest ITL)
        row(1500, 60),  # 5: dominated by 4 (same TTFT, higher ITL)
        {"max-num-seqs": "8", "error": "the server exited with status 1"},  # 6: ignored
        row(10, 10, completed=0),  # 7: completed nothing: ignored
    ]
    assert pareto_front(rows) == [0, 1, 3, 4]
    assert pareto_front([]) == []


def test_goodput_front_trades_attainment_for_throughput() -> None:
    rows = [
        row(500, 300, good=0.95, tput=10),  # 0: front (best share)
        row(800, 200, good=0.80, tput=20),  # 1: front
        row(900, 250, good=0.80, tput=15),  # 2: dominated by 1
        row(800, 200, good=0.80, tput=20),  # 3: equal to 1: both on the front
        row(100, 50, good=0.50, tput=30),  # 4: front (best throughput)
        row(100, 50, good=None, tput=40),  # 5: no goodput figure sorts lowest: front on tput
        {"max-num-seqs": "8", "error": "the server exited with status 1"},  # 6: ignored
        row(10, 10, completed=0),  # 7: completed nothing: ignored
    ]
    assert goodput_front(rows) == [0, 1, 3, 4, 5]
    assert goodput_front([]) == []


def test_goodput_front_over_capacities() -> None:
    rows = [row(500, 90, capacity_90=4.0, capacity_99=1.0),  # 0: front (best 90%)
            row(500, 90, capacity_90=3.0, capacity_99=2.5),  # 1: front (best 99%)
            row(500, 90, capacity_90=3.0, capacity_99=2.0),  # 2: dominated by 1
            row(500, 90, capacity_90=None, capacity_99=None)]  # 3: no rate met: dominated
    assert goodput_front(rows) == [0, 1]
    rec = recommend(rows, SLOS)
    assert rec is not None and rec.index == 0 and rec.meets_slos
    assert rec.reason == ("the highest capacity: 4 req/s with >= 90% of requests within TTFT "
                          "<= 1000 ms and every gap <= 100 ms (>= 99%: 1 req/s), of 4 settings")
    rec = recommend([row(1, 1, good=0.2, capacity_90=None, capacity_99=None),
                     row(1, 1, good=0.3, capacity_90=None, capacity_99=None)], SLOS)
    assert rec is not None and rec.index == 1 and not rec.meets_slos  # best share breaks it
    assert "at any rate tried" in rec.reason


def test_recommend_the_highest_goodput_share() -> None:
    rows = [
        row(500, 300, good=0.8),
        row(800, 90, good=0.92),  # the best share
        row(950, 95, good=0.9),
        row(400, 50, good=0.85),
    ]
    rec = recommend(rows, SLOS)
    assert rec is not None and rec.index == 1 and rec.meets_slos
    assert rec.reason == ("the highest goodput share: 92% of requests within TTFT <= 1000 ms "
                          "and every gap <= 100 ms, of 4 settings")


def test_recommend_ties_go_to_throughput_then_headroom_then_grid_order() -> None:
    rows = [row(900, 90, good=0.9, tput=10), row(800, 90, good=0.9, tput=12),
            row(500, 50, good=0.9, tput=12), row(500, 50, good=0.9, tput=12)]
    rec = recommend(rows, SLOS)
    assert rec is not None and rec.index == 2  # 1 and 2 tie on throughput; 2 has headroom
    # No goodput figure at all sorts below any measured share.
    rec = recommend([row(100, 10, good=None), row(900, 90, good=0.0)], SLOS)
    assert rec is not None and rec.index == 1


def test_recommend_when_none_keeps_90_percent_is_the_closest() -> None:
    rows = [row(3000, 50, good=0.5), row(1500, 150, good=0.1), row(1200, 180, good=0.2)]
    assert [slo_ratio(r, SLOS) for r in rows] == [3.0, 1.5, 1.8]
    rec = recommend(rows, SLOS)
    assert rec is not None and rec.index == 0 and not rec.meets_slos
    assert rec.reason.endswith("this one comes closest with 50%")
    assert recommend([{"error": "x"}], SLOS) is None


def test_slos_must_be_positive_and_finite() -> None:
    for bad in (0.0, -5.0, float("inf")):
        with pytest.raises(ConfigError, match="--slo-ttft-ms must be a positive"):
            Slos(ttft_ms=bad)
    with pytest.raises(ConfigError, match="--slo-itl-ms must be a positive"):
        Slos(itl_ms=0.0)


def test_grid_takes_any_engine_flag_in_either_spelling() -> None:
    import dataclasses

    from tailserve.analyze.sweep import combo_flags, parse_grid
    from tailserve.config import EngineArgs

    grid = parse_grid(["max_num_batched_tokens=256,512", "--max-num-seqs=8,32"])
    assert grid == [
        {"max-num-batched-tokens": "256", "max-num-seqs": "8"},
        {"max-num-batched-tokens": "256", "max-num-seqs": "32"},
        {"max-num-batched-tokens": "512", "max-num-seqs": "8"},
        {"max-num-batched-tokens": "512", "max-num-seqs": "32"}]
    assert combo_flags(grid[3]) == ["--max-num-batched-tokens", "512", "--max-num-seqs", "32"]
    # Every engine field is a grid axis: a knob added to EngineArgs is tunable as it lands.
    for f in dataclasses.fields(EngineArgs):
        if f.name != "model":
            assert parse_grid([f"{f.name}=1"]) == [{f.name.replace("_", "-"): "1"}]


def test_html_page_has_both_plots_the_table_and_the_recommendation() -> None:
    rows = [{"max-num-seqs": "4", **row(500, 300, good=0.7)},
            {"max-num-seqs": "16", **row(800, 90, good=0.9)},
            {"max-num-seqs": "64", "error": "the server exited with status 1: <boom>"}]
    t = analyze_rows(rows, ["max-num-seqs"], SLOS, "10 random prompts")
    page = render_tune_html(t.rows, t.keys, SLOS, t.recommended, t.workload)
    assert "id='plot-front'" in page and "id='plot-goodput'" in page
    assert page.count("data:image/png;base64,") == 2
    assert "<b>Recommended:</b> max-num-seqs=16" in page
    assert "&lt;boom&gt;" in page and "<boom>" not in page  # the server's log is escaped
    # 16 has the best share, 4 nothing better on throughput (equal): 4 is dominated by 16.
    assert "<td>recommended</td><td>16</td>" in page and "<td></td><td>4</td>" in page
    rows[0]["output_throughput"] = 30.0  # now 4 trades share for throughput: on the front
    t = analyze_rows(rows, ["max-num-seqs"], SLOS, "10 random prompts")
    assert t.front == [1, 0]
    page = render_tune_html(t.rows, t.keys, SLOS, t.recommended, t.workload)
    assert "<td>front</td><td>4</td>" in page
    rows[0] |= {"failed": 2, "failure": "http: HTTP 500 <oops>"}
    page = render_tune_html(rows, ["max-num-seqs"], SLOS, t.recommended, t.workload)
    assert "<td>http: HTTP 500 &lt;oops&gt;</td>" in page
    # A setting that completed nothing has no latency to plot (its zeros are not a point).
    nothing = {"max-num-seqs": "2", **row(0, 0, good=0.0), "completed": 0, "failed": 10}
    page = render_tune_html([nothing], ["max-num-seqs"], SLOS, None, "w")
    assert "<p class='note' id='plot-front'>not available" in page
    empty = render_tune_html([rows[2]], ["max-num-seqs"], SLOS, None, "w")
    assert "No setting completed a request" in empty and "id='plot-front'" in empty


def test_tune_usage_errors_exit_2_before_any_server(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert main(["tune", "--grid", "max-num-seqs=4", "--slo-itl-ms", "-1"]) == 2
    assert "--slo-itl-ms must be a positive number of milliseconds, got -1" in \
        capsys.readouterr().err
    assert main(["tune", "--grid", "max-num-seks=4"]) == 2
    assert "not a serve engine flag" in capsys.readouterr().err
    assert main(["tune", "--grid", "max-num-seqs=4", "--html", "/nonexistent/x.html"]) == 2
    assert "does not exist" in capsys.readouterr().err


# Two tiny-model servers, one after the other (the first drains while the second starts), and
# four short requests each: ~40 s on 2 quiet cores, most of it the servers' start-up.
@pytest.mark.slow
def test_tune_runs_each_setting_on_its_own_server(tiny_model_dir: str, tmp_path: Path) -> None:
    html, saved = tmp_path / "tune.html", tmp_path / "tune.json"
    rc = main(["tune", tiny_model_dir, "--grid", "max_num_seqs=1,4", "--num-prompts", "4",
               "--input-len", "16", "--output-len", "4", "--request-rate", "inf",
               "--serve-arg=--kv-cache-memory=0.05", "--html", str(html),
               "--save-result", str(saved), "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"])
    assert rc == 0
    result = json.loads(saved.read_text())
    assert result["grid"] == ["max-num-seqs"]
    assert [r["max-num-seqs"] for r in result["rows"]] == ["1", "4"]
    for r in result["rows"]:
        assert "error" not in r, r.get("error")
        assert r["completed"] == 4 and r["failed"] == 0
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["goodput_share"] == 1.0  # SLOs no run on this machine can miss
    # Each server got its own setting: four requests sent at once ran one by one on the
    # first, and several to a step on the second (the engine's timeline says so).
    assert result["rows"][0]["max_scheduled_seqs"] == 1
    assert result["rows"][1]["max_scheduled_seqs"] > 1
    assert result["recommended"]["meets_slos"] is True
    assert result["pareto_front"] and result["recommended"]["index"] in (0, 1)
    page = html.read_text()
    # The page names the recommended setting, whichever of the two it is (both meet the SLOs;
    # the tie-break depends on this run's timings).
    chosen = result["rows"][result["recommended"]["index"]]["max-num-seqs"]
    assert "id='plot-front'" in page and f"max-num-seqs={chosen}" in page
