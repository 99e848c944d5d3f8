"""tailserve compare: the bootstrap's arithmetic, known shifts found, no shift not flagged
(at the promised rate), the gate, replicates, and the command on result files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tailserve.analyze.bootstrap import (
    GroupedSample,
    bootstrap_percentiles,
    percentile_interval,
    weighted_percentiles,
)
from tailserve.analyze.compare import (
    BETTER,
    SAME,
    WORSE,
    CompareError,
    CompareOptions,
    RunSamples,
    compare_runs,
    load_run,
)
from tailserve.cli import main


def _run(ttft_ms: np.ndarray, itl_ms: list[list[float]] | None = None) -> RunSamples:
    """A run whose TTFT/TPOT/E2EL are ``ttft_ms`` (the statistics do not care which)."""
    scalar = [[float(x)] for x in ttft_ms]
    values = {"ttft": scalar, "tpot": scalar, "e2el": scalar,
              "itl": itl_ms if itl_ms is not None else scalar}
    return RunSamples("mem", "mem", values, len(ttft_ms), 0)


def test_weighted_percentiles_equal_numpy_on_the_repeated_sample() -> None:
    rng = np.random.default_rng(0)
    qs = np.array([0.0, 13.7, 50.0, 99.0, 100.0])
    for _ in range(100):
        n = int(rng.integers(1, 40))
        values = np.sort(rng.normal(size=n))
        weights = rng.integers(0, 4, size=(4, n))
        weights[0] = 1  # the original sample
        got = weighted_percentiles(values, weights, qs)
        for row in range(4):
            rep = np.repeat(values, weights[row])
            if rep.size:
                np.testing.assert_allclose(got[row], np.percentile(rep, qs))
            else:
                assert np.isnan(got[row]).all()


def test_cluster_bootstrap_equals_explicit_resampling_of_groups() -> None:
    """The windowed search gives exactly the percentiles of the groups drawn, concatenated."""
    rng = np.random.default_rng(1)
    qs = [0.0, 50.0, 99.0, 100.0]
    for trial in range(30):
        groups = int(rng.integers(1, 200))
        lists = [list(rng.exponential(size=int(rng.integers(0, 20)))) for _ in range(groups)]
        sample = GroupedSample.from_lists(lists)
        got = bootstrap_percentiles(sample, qs, 25, np.random.default_rng(trial))
        draws = np.random.default_rng(trial).integers(0, groups, size=(25, groups))
        for row in range(25):
            vals = np.concatenate([np.asarray(lists[i], dtype=float) for i in draws[row]])
            if vals.size:
                np.testing.assert_allclose(got[row], np.percentile(vals, qs))
            else:
                assert np.isnan(got[row]).all()


def test_known_shift_is_detected_both_ways() -> None:
    rng = np.random.default_rng(2)
    a = rng.lognormal(3.0, 0.5, 600)
    opts = CompareOptions(metrics=("ttft", "itl"))
    slower = compare_runs([_run(a)], [_run(rng.lognormal(3.0, 0.5, 600) * 1.4)], opts)
    for m in slower.metrics:
        assert m.verdict == WORSE and m.gate_failed
        assert m.diff[99.0].ci_ms[0] > 0 and m.p_value < 1e-6
    assert not slower.passed
    faster = compare_runs([_run(a)], [_run(rng.lognormal(3.0, 0.5, 600) * 0.7)], opts)
    assert all(m.verdict == BETTER and not m.gate_failed for m in faster.metrics)
    assert faster.passed


def test_tail_only_regression_is_judged_at_the_percentile() -> None:
    """Same median, a fatter tail: the P99 verdict sees it even where a rank test may not."""
    rng = np.random.default_rng(3)
    a = rng.normal(100.0, 5.0, 2000)
    b = rng.normal(100.0, 5.0, 2000)
    b[:60] = rng.uniform(200.0, 300.0, 60)  # 3% of requests hit a stall
    m = compare_runs([_run(a)], [_run(b)], CompareOptions(metrics=("ttft",))).metrics[0]
    assert m.verdict == WORSE
    assert m.diff[50.0].ci_ms[0] < 2.0  # the median barely moves


def test_threshold_gates_only_regressions_beyond_it() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.lognormal(3.0, 0.3, 2000), rng.lognormal(3.0, 0.3, 2000) * 1.15
    opts = CompareOptions(metrics=("ttft",))
    strict = compare_runs([_run(a)], [_run(b)], opts)
    assert strict.metrics[0].verdict == WORSE and not strict.passed
    lenient = compare_runs([_run(a)], [_run(b)],
                           CompareOptions(metrics=("ttft",), threshold_pct=40.0))
    assert lenient.metrics[0].verdict == WORSE and lenient.passed


@pytest.mark.parametrize("confidence", [0.95, 0.8])
def test_false_positive_rate_is_near_one_minus_confidence(confidence: float) -> None:
    """Two samples of one distribution, 200 seeds: the share flagged (better or worse) at P99
    must be about 1 − confidence (binomial s.d. 1.5% at 5%, 2.8% at 20%)."""
    seeds, flagged = 200, 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        a, b = rng.lognormal(3.0, 0.5, 400), rng.lognormal(3.0, 0.5, 400)
        c = compare_runs([_run(a)], [_run(b)], CompareOptions(
            metrics=("ttft",), confidence=confidence, num_resamples=500, seed=seed))
        flagged += c.metrics[0].verdict != SAME
    rate = flagged / seeds
    alpha = 1 - confidence
    assert alpha / 3 <= rate <= alpha * 2, rate


def _width(samples: np.ndarray) -> float:
    lo, hi = percentile_interval(samples, 0.95)
    return hi - lo


def test_itl_gaps_are_resampled_with_their_request() -> None:
    """A request's gaps move together (same batches): the interval must be as wide as the
    number of requests allows, not narrowed by the number of gaps (here ~sqrt(50) = 7x)."""
    rng = np.random.default_rng(5)
    lists = [list(x * (1 + 0.01 * rng.standard_normal(50)))
             for x in rng.lognormal(3.0, 0.5, 100)]
    clustered = bootstrap_percentiles(GroupedSample.from_lists(lists), [50.0], 1000, rng)
    naive = bootstrap_percentiles(GroupedSample.independent(np.concatenate(lists)), [50.0],
                                  1000, rng)
    assert _width(clustered[:, 0]) > 4 * _width(naive[:, 0])


def _pooled(runs: list[RunSamples]) -> RunSamples:
    values = {m: [req for r in runs for req in r.values[m]] for m in runs[0].values}
    return RunSamples("pooled", "pooled", values, sum(r.num_requests for r in runs), 0)


def test_replicates_resample_whole_runs() -> None:
    """Runs that differ by a run-level factor: resampling runs sees that spread, resampling
    the same requests pooled does not, and says it resampled requests."""
    rng = np.random.default_rng(6)

    def runs() -> list[RunSamples]:
        return [_run(rng.lognormal(3.0, 0.1, 300) * rng.uniform(0.7, 1.3)) for _ in range(6)]

    a, b = runs(), runs()
    opts = CompareOptions(metrics=("ttft",), percentile=50.0)
    by_run = compare_runs(a, b, opts)
    by_request = compare_runs([_pooled(a)], [_pooled(b)], opts)
    assert (by_run.unit, by_request.unit) == ("runs", "requests")
    run_ci, req_ci = by_run.metrics[0].diff[50.0].ci_pct, by_request.metrics[0].diff[50.0].ci_pct
    assert run_ci[1] - run_ci[0] > 3 * (req_ci[1] - req_ci[0])
    assert any("replicates on one side" in n for n in compare_runs(a, b[:1], opts).notes)
    assert compare_runs(a, b[:1], opts).unit == "requests"


def _write_result(path: Path, rng: np.random.Generator, scale: float, n: int = 300) -> str:
    """A tailserve bench result as result.py writes it (the keys compare reads)."""
    reqs = []
    for i in range(n):
        ttft = float(rng.lognormal(-3.0, 0.4)) * scale
        itls = list(rng.lognormal(-4.0, 0.3, 15) * scale)
        reqs.append({"index": i, "send_s": 0.01 * i, "error_type": None, "ttft_s": ttft,
                     "itl_s": itls, "e2el_s": ttft + sum(itls), "output_tokens": 16})
    reqs.append({"index": n, "send_s": 0.0, "error_type": "server_error", "ttft_s": None,
                 "itl_s": [], "e2el_s": None, "output_tokens": None})
    path.write_text(json.dumps({"label": path.stem, "completed": n,
                                "tailserve": {"requests": reqs}}))
    return str(path)


def test_cli_gates_on_a_regression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(7)
    a = _write_result(tmp_path / "a.json", rng, 1.0)
    same = _write_result(tmp_path / "same.json", rng, 1.0)
    slow = _write_result(tmp_path / "slow.json", rng, 1.5)
    assert main(["compare", a, slow, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False and out["resampling"] == "requests"
    assert set(out["metrics"]) == {"ttft", "tpot", "itl", "e2el"}
    ttft = out["metrics"]["ttft"]
    assert ttft["verdict"] == WORSE and ttft["gate"] == "fail"
    assert ttft["a"]["n"] == 300 and out["a"]["num_failed"] == 1
    assert ttft["diff"]["p99"]["ci_ms"][0] > 0
    assert {"p50_ms", "p99_ms"} <= set(ttft["b"])
    assert out["metrics"]["itl"]["a"]["n"] == 300 * 15
    assert main(["compare", a, same, "--metric", "ttft,itl"]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "requests resampled" in text and "TTFT" in text


def test_cli_reads_vllm_detailed_results_and_rejects_summaries(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"ttfts": [0.1, 0.2, 0.0], "itls": [[0.01, 0.02], [0.03], []],
                                "output_lens": [3, 2, 0], "errors": ["", "", "boom"]}))
    run = load_run(str(vllm))
    assert run.num_failed == 1
    assert run.values["e2el"] == [[pytest.approx(130.0)], [pytest.approx(230.0)]]
    assert run.values["tpot"] == [[pytest.approx(15.0)], [pytest.approx(30.0)]]
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": [{"result_file": "x-step0.json"}]}))
    with pytest.raises(CompareError, match=r"x-step0\.json"):
        load_run(str(summary))
    assert main(["compare", str(summary), str(vllm)]) == 2
    assert main(["compare", str(vllm), str(vllm), "--metric", "ttft,nope"]) == 2
    assert "--metric" in capsys.readouterr().err


# ---------------------------------------------------------------- goodput and capacity gates
def _slo_result(path: Path, ttfts: list[float], slos: dict[str, float] | None = None,
                stamped: dict[str, float] | None = None) -> str:
    """A bench result whose requests have these TTFTs (s), one 10 ms gap each, and optionally
    the SLOs the bench judged (its goodput block) or the server's per-request stamp."""
    reqs = [{"send_s": 0.0, "error_type": None, "ttft_s": t, "itl_s": [0.01], "e2el_s": t + 0.01,
             "output_tokens": 2,
             "server_timing": None if stamped is None else {"slo": stamped}} for t in ttfts]
    good = None if slos is None else {f"{k}_ms": v for k, v in slos.items()}
    path.write_text(json.dumps({"label": path.stem, "tailserve": {"requests": reqs,
                                                                  "goodput": good}}))
    return str(path)


def test_goodput_gate_from_the_flags_the_run_or_the_server(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A: 95 of 100 within 1 s; B: 70 of 100.
    a = _slo_result(tmp_path / "a.json", [0.5] * 95 + [2.0] * 5, slos={"ttft": 1000.0})
    b = _slo_result(tmp_path / "b.json", [0.5] * 70 + [2.0] * 30, slos={"ttft": 1000.0})
    assert main(["compare", a, b, "--json", "--metric", "ttft"]) == 1
    out = json.loads(capsys.readouterr().out)
    g = out["goodput"]
    assert (g["a"], g["b"], g["source"], g["slos_ms"]) == (0.95, 0.70, "A's bench run",
                                                           {"ttft": 1000.0})
    assert g["diff"] == pytest.approx(-0.25) and g["pct"] == pytest.approx(-25 / 0.95)
    assert g["verdict"] == WORSE and g["gate"] == "fail" and g["ci"][1] < 0
    # The P99 TTFT is 2 s on both sides: only the goodput gate fails.
    assert out["metrics"]["ttft"]["gate"] == "pass" and out["passed"] is False
    # Flags win over the run's SLOs: at 3 s everyone is good on both sides.
    assert main(["compare", a, b, "--json", "--metric", "ttft", "--slo-ttft-ms", "3000"]) == 0
    g = json.loads(capsys.readouterr().out)["goodput"]
    assert (g["a"], g["b"], g["source"], g["verdict"]) == (1.0, 1.0, "flags", SAME)
    # No SLO in the files: each request's own, as the server stamped it.
    stamp = {"ttft_s": 1.0, "itl_s": 0.005, "tpot_s": None}
    a2 = _slo_result(tmp_path / "a2.json", [0.5] * 10, stamped=stamp)
    assert main(["compare", a2, a2, "--json", "--metric", "ttft"]) == 0
    g = json.loads(capsys.readouterr().out)["goodput"]
    assert (g["a"], g["source"]) == (0.0, "server timing")  # every 10 ms gap misses 5 ms
    plain = _write_result(tmp_path / "plain.json", np.random.default_rng(1), 1.0, n=20)
    assert main(["compare", plain, plain, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["goodput"] is None  # no SLO anywhere
    assert main(["compare", a, b, "--slo-itl-ms", "-3"]) == 2
    assert "--slo-itl-ms must be a positive number of milliseconds, got -3" in \
        capsys.readouterr().err


def _sweep(path: Path, targets: list[tuple[float, float | None, float | None]]) -> str:
    path.write_text(json.dumps({"steps": [], "capacity": {"targets": [
        {"target": t, "capacity_req_s": r, "lowest_missing_rate": m, "resolved": True}
        for t, r, m in targets]}}))
    return str(path)


def test_capacity_gate_compares_the_brackets(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    a = _sweep(tmp_path / "a.json", [(0.9, 4.0, 4.4), (0.99, 2.0, 2.2)])
    # B missed 90% at 3.5 req/s, where A was measured to meet it; 99%: brackets overlap.
    b = _sweep(tmp_path / "b.json", [(0.9, 3.2, 3.5), (0.99, 2.1, 2.3)])
    assert main(["compare", a, b, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    c90, c99 = out["capacity"]
    assert (c90["verdict"], c90["gate"], c90["ratio"]) == (WORSE, "fail", pytest.approx(0.8))
    assert (c99["verdict"], c99["gate"]) == (SAME, "pass")
    # With a 25% threshold B's miss at 3.5 is above 0.75 x 4: within it.
    assert main(["compare", a, b, "--threshold", "25"]) == 0
    assert "capacity at >= 90%: A 4 (missed at 4.4) req/s, B 3.2 (missed at 3.5)" in \
        capsys.readouterr().out
    # The mirror: B better at 90% (A missed at 4.4, below B's 5.0).
    better = _sweep(tmp_path / "c.json", [(0.9, 5.0, None), (0.99, 2.0, 2.2)])
    assert main(["compare", a, better, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity"][0]["verdict"] == BETTER
