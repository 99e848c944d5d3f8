"""benchmarks/performance_page.py: docs/performance.md from the peers harness's JSON, exactly,
and tolerant of workloads, servers and keys it does not know."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("performance_page",
                                                  ROOT / "benchmarks" / "performance_page.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["performance_page"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _row(server: str, workload: str, **figures: Any) -> dict[str, Any]:
    return {"server": server, "workload": workload, "round": 0, "client_cmd": "x", **figures}


# A small report as serving_peers.py writes it, plus what another branch may add: a workload
# the renderer does not know ("burst"), a key it does not know ("slo_attainment"), a failed row.
REPORT: dict[str, Any] = {
    "commit": "abc1234", "date": "2026-12-03 03:41 UTC",
    "machine": {"cpus": 2, "cpu": "AMD EPYC 9R14"}, "smoke": False, "client": "vllm",
    "workloads": [{"name": "single"}, {"name": "saturated"}, {"name": "burst"}],
    "slos_ms": {"ttft_ms": 2000.0, "itl_ms": 250.0},
    "load_average_before": [1.3, 1.1, 1.0], "load_average_after": [2.5, 1.8, 1.2],
    "warnings": ["mixed rate 0.5 req/s is not well below llama.cpp's capacity"],
    "argv": ["/abs/benchmarks/serving_peers.py", "--servers", "tailserve,llama.cpp,vllm",
             "--workloads", "single,saturated,burst"],
    "rows": [
        _row("tailserve", "single", median_ttft_ms=219.5, median_tpot_ms=8.14,
             roofline_ms=3.1, slo_attainment=0.9),
        _row("llama.cpp", "single", median_ttft_ms=782.4, median_tpot_ms=9.6),
        _row("vllm", "single", median_ttft_ms=358.7, median_tpot_ms=37.0),
        _row("tailserve", "saturated", output_throughput=200.2, p99_ttft_ms=7482.0,
             p99_itl_ms=395.5),
        _row("llama.cpp", "saturated", output_throughput=40.4, p99_ttft_ms=30719.0,
             p99_itl_ms=9235.0),
        {**_row("vllm", "saturated"), "error": "the client failed"},
        _row("tailserve", "burst", p99_ttft_ms=100.0, p99_itl_ms=20.0, output_throughput=50.0,
             goodput_share=0.95),
    ],
}

EXPECTED_SECTION = """\
## AMD EPYC 9R14, 2 cores

| workload | figure | tailserve | vLLM-CPU | llama-server | roofline |
|---|---|---:|---:|---:|---:|
| single | TTFT P50 (ms) | 219.5 | 358.7 | 782.4 | — |
| single | TPOT P50 (ms) | 8.14 | 37.00 | 9.60 | 3.10 |
| saturated | output tok/s | 200.2 | — | 40.4 | — |
| saturated | TTFT P99 (ms) | 7,482.0 | — | 30,719.0 | — |
| saturated | ITL P99 (ms) | 395.5 | — | 9,235.0 | — |
| burst | TTFT P99 (ms) | 100.0 | — | — | — |
| burst | ITL P99 (ms) | 20.0 | — | — | — |
| burst | output tok/s | 50.0 | — | — | — |
| burst | goodput share (%) | 95 | — | — | — |

`peers-zen4.json`: commit abc1234, date 2026-12-03 03:41 UTC, AMD EPYC 9R14, 2 cores, client \
`vllm`, load average [1.3, 1.1, 1.0] before, [2.5, 1.8, 1.2] after, goodput SLOs TTFT <= 2000 \
ms and no gap > 250 ms.

    python benchmarks/serving_peers.py --servers tailserve,llama.cpp,vllm --workloads \
single,saturated,burst

- warning: mixed rate 0.5 req/s is not well below llama.cpp's capacity
"""


def test_renders_the_fixture_exactly(pp: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "peers-zen4.json").write_text(json.dumps(REPORT), encoding="utf-8")
    page = pp.render(pp.load_reports(tmp_path))
    assert EXPECTED_SECTION in page
    runs = page[page.index("## Runs"):page.index("## Method")]
    assert runs == ("## Runs\n\n- `peers-zen4.json`: commit abc1234, date 2026-12-03 03:41 UTC, "
                    "AMD EPYC 9R14, 2 cores, client `vllm`, load average [1.3, 1.1, 1.0] "
                    "before, [2.5, 1.8, 1.2] after, goodput SLOs TTFT <= 2000 ms and no gap > "
                    "250 ms\n\n")
    assert len(page.splitlines()) <= 150


def test_rounds_and_variants(pp: ModuleType) -> None:
    rows = [_row("tailserve[after]", "single", median_ttft_ms=v, round=i)
            for i, v in enumerate((3.0, 1.0, 2.0))]
    rows.append(_row("tailserve[before]", "single", median_ttft_ms=9.0))
    report = {"rows": rows, "workloads": [{"name": "single"}]}
    assert pp.run_table(report)[:3] == [
        "| workload | figure | tailserve[after] | tailserve[before] | roofline |",
        "|---|---|---:|---:|---:|",
        "| single | TTFT P50 (ms) | 2.0 | 9.0 | — |",  # the median of the three rounds
    ]


def test_rows_left_out_of_a_run_are_named_where_the_run_is_described(pp: ModuleType) -> None:
    plain = pp.describe(REPORT, "a.json")
    assert "Rows left out" not in plain
    left = pp.describe({**REPORT, "rows_left_out": "tailserve[before]: an A/B row"}, "a.json")
    assert left == plain + ". Rows left out: tailserve[before]: an A/B row"


def test_a_smoke_run_is_listed_not_tabled_and_no_run_says_so(pp: ModuleType) -> None:
    smoke = {**REPORT, "smoke": True}
    page = pp.render({"smoke.json": smoke})
    assert "## AMD EPYC" not in page
    assert "No measured run has been committed yet." in page
    assert "(smoke: a test of the harness, not a measurement)" in page
    empty = pp.render({})
    assert "None in `benchmarks/results/peers/`." in empty


def test_latest_run_of_a_class_wins(pp: ModuleType) -> None:
    old = {**REPORT, "commit": "old0001"}
    page = pp.render({"2026-12-01.json": old, "2026-12-03.json": REPORT})
    assert page.count("## AMD EPYC 9R14, 2 cores") == 1
    assert "`2026-12-03.json`: commit abc1234" in page.split("## Runs")[0]


def test_the_committed_page_is_what_make_docs_writes(pp: ModuleType) -> None:
    committed = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert committed == pp.render(pp.load_reports(pp.RESULTS),
                                  pp.load_reports(pp.real_sizes_page.RESULTS)), (
        "docs/performance.md is stale: run `make docs`")


def test_real_size_runs_are_tabled_newest_first_without_smoke_runs(pp: ModuleType) -> None:
    def run(date: str, model: str, **extra: Any) -> dict[str, Any]:
        return {"commit": "c0ffee1", "date": date, "model": {"name": model},
                "argv": ["/abs/benchmarks/real_sizes.py", "--shape", model[:12],
                         "--peers-arg=--variant=amx-bf16=X --slo-itl-ms none"],
                "machine": {"cpus": 2, "cpu": "Intel(R) Xeon(R) Processor"},
                "load_average_before": [0.4, 0.5, 0.6], "load_average_after": [2.0, 1.0, 1.0],
                "rows": [
                    _row("tailserve[amx]", "single", median_tpot_ms=215.04,
                         tpot_over_roofline=1.431),
                    _row("llama.cpp", "single", median_tpot_ms=480.0),  # no roofline ratio
                    _row("tailserve[amx]", "prompt2000", median_ttft_ms=38123.4),
                    {**_row("llama.cpp", "prompt2000"), "error": "timed out"},
                    _row("tailserve[amx]", "saturated", output_throughput=9.87),
                ], **extra}

    page = pp.render({"2026-12-03.json": REPORT}, {
        "2026-12-04-1b.json": run("2026-12-04 21:27 UTC", "llama-3.2-1b-Q4_0"),
        "2026-12-05-8b.json": run("2026-12-05 00:06 UTC", "llama-3.1-8b-Q4_0"),
        "2026-12-05-smoke.json": run("2026-12-05 01:00 UTC", "smoke-model", smoke=True)})
    section = page.split("## Real sizes")[1].split("## Runs")[0]
    assert "**Timings on random weights with `ignore_eos` are real timings:**" in section
    assert "smoke-model" not in page
    assert section.index("### llama-3.1-8b-Q4_0") < section.index("### llama-3.2-1b-Q4_0")
    assert ("### llama-3.1-8b-Q4_0: Intel(R) Xeon(R) Processor, 2 cores, 2026-12-05 00:06 UTC"
            in section)
    assert "`2026-12-05-8b.json`: commit c0ffee1, load 0.4 before, 2.0 after." in section
    assert "| workload | tailserve[amx] | llama-server |" in section
    assert ("| single: TPOT P50 (x the stored-bytes roofline) | 215.0 (1.43x roofline) | 480.0 |"
            in section)
    assert "| prompt2000: TTFT P50 | 38,123.4 | — |" in section
    assert "| saturated: output tok/s | 9.9 | — |" in section
    assert ("    python benchmarks/real_sizes.py --shape llama-3.1-8b "
            "'--peers-arg=--variant=amx-bf16=X --slo-itl-ms none'") in section
    # Without real-size reports the page has no such section.
    assert "## Real sizes" not in pp.render({"2026-12-03.json": REPORT})


def _cap(rates: dict[float, float], capacity: float | None, missing: float | None,
         resolved: bool) -> dict[str, Any]:
    return {"workload": "chat", "num_prompts": 30, "slos_ms": {"ttft_ms": 1000.0, "itl_ms": 100.0},
            "targets": [{"target": 0.9, "capacity_req_s": capacity,
                         "lowest_missing_rate": missing, "resolved": resolved},
                        {"target": 0.99, "capacity_req_s": None, "lowest_missing_rate": 0.25,
                         "resolved": False}],
            "points": [{"rate": r, "goodput_share": g} for r, g in rates.items()]}


def test_a_runs_command_is_shell_quoted(pp: ModuleType) -> None:
    """A capacity-only run is given ``--workloads ''``: the page's line must keep the empty
    argument (unquoted it read "--workloads  --capacity", which runs something else)."""
    report = {**REPORT, "argv": ["/abs/benchmarks/serving_peers.py", "--workloads", "",
                                 "--variant", "amx-bf16=X=1 --slo-itl-ms none"]}
    assert pp.command(report) == ("python benchmarks/serving_peers.py --workloads '' "
                                  "--variant 'amx-bf16=X=1 --slo-itl-ms none'")
    assert pp.command({**REPORT, "argv": []}) == "not recorded"


def test_capacity_and_targets_are_read_off_the_runs(pp: ModuleType) -> None:
    """The latest run with a capacity sweep gives the capacity table (a bound where the search
    did not bracket the rate), and the targets are computed from the figures, met or not."""
    main = {**REPORT, "rows": [
        _row("tailserve", "mixed", p99_ttft_ms=1368.2, p99_itl_ms=90.4),
        _row("vllm", "mixed", p99_ttft_ms=1182.0, p99_itl_ms=525.8),
        _row("tailserve", "prompt128", median_ttft_ms=76.0),
        _row("vllm", "prompt128", median_ttft_ms=121.8),
        _row("tailserve", "long-mix", short_p99_ttft_ms=154.1, short_median_ttft_ms=80.8),
        _row("tailserve", "structured", constrained_p99_ttft_ms=321.7,
             unconstrained_p99_ttft_ms=250.0, p50_itl_constrained_over_unconstrained=0.97),
        _row("vllm", "structured", constrained_p99_ttft_ms=376.4),
    ]}
    sweep = {**REPORT, "commit": "cap0001", "rows": [], "capacity": {
        "vllm": _cap({0.5: 0.5, 0.25: 0.8}, None, 0.25, False),
        "tailserve": _cap({0.5: 0.83, 0.25: 0.97, 0.42: 0.93}, 0.42, 0.5, True),
        "llama.cpp": _cap({0.25: 0.6, 0.125: 0.9}, 0.125, 0.25, False),
    }}
    page = pp.render({"2026-12-03-cap.json": sweep, "2026-12-04.json": main})
    assert ("| tailserve | 0.42 (< 0.5) | < 0.25 | 0.25 → 97%, 0.42 → 93%, 0.5 → 83% |\n"
            "| vLLM-CPU | < 0.25 | < 0.25 | 0.25 → 80%, 0.5 → 50% |\n"
            "| llama-server | 0.125 (< 0.25) | < 0.125 | 0.125 → 90%, 0.25 → 60% |") in page
    assert "`2026-12-03-cap.json`: commit cap0001" in page.split("## Runs")[0]
    assert ("| 29: mixed P99 TTFT <= vLLM's | 1,368.2 | 1,182.0 | 1.16x | **not met** |\n"
            "| 29: mixed P99 ITL <= 1/2 vLLM's | 90.4 | 525.8 | 0.17x | met |\n"
            "| 29: long-mix short TTFT P99 <= 3x P50 | 154.1 | 80.8 | 1.91x | met |\n"
            "| 29: capacity at SLO >= 1.5x vLLM-CPU's (req/s) | 0.420 | < 0.250 | > 1.68x | met |\n"
            "| 29: capacity at SLO >= 3x llama-server's (req/s) | 0.420 | 0.125 | 3.36x | met |\n"
            "| 30: TTFT of a 128-token prompt <= 0.7x vLLM's | 76.0 | 121.8 | 0.62x | met |\n"
            "| 33: structured TTFT P99, constrained <= 1.2x unconstrained | 321.7 | 250.0 | "
            "1.29x | **not met** |\n"
            "| 33: structured TTFT P99, constrained <= vLLM's constrained | 321.7 | 376.4 | "
            "0.85x | met |\n"
            "| 33: structured ITL P50, constrained / unconstrained <= 1.1 | 0.97 | 1.00 | "
            "0.97x | met |") in page
    # vLLM's capacity was below every rate tried: the ratio is a bound (0.42 / 0.25), met.
    assert len(page.splitlines()) <= 150


def test_each_capacity_ratio_comes_from_the_peers_run_beside_tailserve(pp: ModuleType) -> None:
    """A later sweep of tailserve and llama-server alone does not hide vLLM's earlier sweep
    beside tailserve: each ratio is read off the run that measured both, and both tables are
    shown."""
    main = {**REPORT, "rows": [_row("tailserve", "mixed", p99_ttft_ms=900.0)]}
    vllm_run = {**REPORT, "commit": "cap0001", "rows": [], "capacity": {
        "tailserve": _cap({0.5: 0.95, 1.0: 0.5}, 0.5, 1.0, True),
        "vllm": _cap({0.25: 0.95, 0.5: 0.6}, 0.25, 0.5, True)}}
    llama_run = {**REPORT, "commit": "cap0002", "rows": [], "capacity": {
        "tailserve": _cap({0.4: 0.95, 0.8: 0.5}, 0.4, 0.8, True),
        "llama.cpp": _cap({0.1: 0.95, 0.2: 0.5}, 0.1, 0.2, True)}}
    page = pp.render({"2026-12-04-a.json": vllm_run, "2026-12-04-b.json": llama_run,
                      "2026-12-05.json": main})
    assert ("| 29: capacity at SLO >= 1.5x vLLM-CPU's (req/s) | 0.500 | 0.250 | 2.00x | met |"
            in page)
    assert ("| 29: capacity at SLO >= 3x llama-server's (req/s) | 0.400 | 0.100 | 4.00x | met |"
            in page)
    tables = page.split("## Runs")[0]
    assert "`2026-12-04-a.json`: commit cap0001" in tables
    assert "`2026-12-04-b.json`: commit cap0002" in tables
