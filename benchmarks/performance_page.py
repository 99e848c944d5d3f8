"""docs/performance.md, rendered from the peers harness's JSON reports, so the page cannot drift
from the runs: per CPU class, the latest committed run of benchmarks/serving_peers.py as one
table of its workloads x {tailserve, vLLM-CPU, llama-server, roofline}, with the commit, date,
machine and the exact command; for each peer, the latest run whose capacity sweep
(``--capacity``) has both it and tailserve, as a capacity table (else the latest sweep); the
issues' targets read off those runs (met or not, with the figures); the real-size runs
(benchmarks/real_sizes.py's reports, real_sizes_page.py); then the method.

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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))

import real_sizes_page  # noqa: E402
from report_cells import cell, column_name, command_line, fmt, server_order  # noqa: E402
from tailserve.bench.capacity import Point, SearchOptions, capacities  # noqa: E402

RESULTS = HERE / "results" / "peers"
PAGE = REPO / "docs" / "performance.md"

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
# promptN (one prompt of N tokens at a time): its TTFT is the figure.
PROMPT_FIGURES = (TTFT_P50, TTFT_P99)
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


def workload_order(report: dict[str, Any]) -> list[str]:
    """The report's workloads in its own order, then any a row names that it does not list."""
    listed = [str(w["name"]) for w in report.get("workloads", []) if "name" in w]
    return list(dict.fromkeys([*listed, *(str(r["workload"]) for r in report["rows"])]))


def command(report: dict[str, Any]) -> str:
    """The harness's command line as run, from the repository root."""
    return command_line("serving_peers.py", report) or "not recorded"


def machine_class(report: dict[str, Any]) -> str:
    m = report.get("machine", {})
    return f"{m.get('cpu', 'unknown CPU')}, {m.get('cpus', '?')} cores"


def run_table(report: dict[str, Any]) -> list[str]:
    rows = report["rows"]
    servers = server_order(rows)
    head = ["workload", "figure", *(column_name(s) for s in servers), "roofline"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(servers) + 1)]
    for w in workload_order(report):
        default = PROMPT_FIGURES if w.startswith("prompt") else DEFAULT_FIGURES
        for fig in FIGURES.get(w, default):
            def get(r: dict[str, Any], fig: Figure = fig) -> Any:
                v = r.get(fig.key)
                return v * fig.scale if isinstance(v, (int, float)) else None

            values = [fmt(cell(rows, s, w, get), fig.digits) for s in servers]
            roof = "—"
            ours = [s for s in servers if s.split("[", 1)[0] == "tailserve"]
            if fig is TPOT_P50 and ours:  # the roofline is tailserve's bytes (the harness's)
                roof = fmt(cell(rows, ours[0], w, lambda r: r.get("roofline_ms")), 2)
            out.append(f"| {w} | {fig.label} | " + " | ".join(values) + f" | {roof} |")
    return out


def _measured(entry: dict[str, Any], target: float) -> tuple[float | None, float | None, bool]:
    """A server's capacity at one attainment target from the rates it was measured at: (the
    highest rate that met it below the lowest that missed, that missing rate, bracketed within
    the search's tolerance). A rate whose client failed is neither: it measured nothing."""
    points = [Point(p["rate"], p["goodput_share"]) for p in entry.get("points", [])
              if isinstance(p.get("goodput_share"), (int, float))]
    tolerance = (entry.get("search") or {}).get("tolerance", SearchOptions.tolerance)
    for c in capacities(points, SearchOptions(targets=(target,), tolerance=tolerance)):
        return c.rate, c.missed_at, c.resolved
    return None, None, False


def _capacity_cell(entry: dict[str, Any], target: float) -> str:
    """A server's capacity at one attainment target: the rate, or a bound when the search did
    not bracket it (">= a" held at every rate tried; "< b" missed at the lowest)."""
    cap, miss, resolved = _measured(entry, target)
    if cap is None:
        return "—" if miss is None else f"< {miss:g}"
    text = f"{cap:.3g}"
    return text if resolved or miss is None else f"{text} (< {miss:g})"


def capacity_table(report: dict[str, Any]) -> list[str]:
    """The rate sweep of a report (serving_peers.py --capacity): per server its capacity at
    >= 90% and >= 99% of requests meeting both SLOs, and each rate tried with its share (or
    that its client failed)."""
    caps: dict[str, dict[str, Any]] = report.get("capacity") or {}
    if not caps:
        return []
    first = next(iter(caps.values()))
    slos = first.get("slos_ms") or {}
    size = f"{first.get('num_prompts', '?')} requests"
    if first.get("min_arrival_s"):
        size += f" (or {first['min_arrival_s']:g} s of arrivals, if more) a rate"
    out = [f"Capacity on the `{first.get('workload', '?')}` workload: the highest request rate "
           f"at which >= 90% (>= 99%) of {size} met TTFT <= "
           f"{slos.get('ttft_ms', 0):g} ms and no gap > {slos.get('itl_ms', 0):g} ms "
           "(`tailserve bench --sweep`'s search).", "",
           "| server | capacity >= 90% (req/s) | >= 99% (req/s) | rates tried: goodput share |",
           "|---|---:|---:|---|"]
    for server in sorted(caps, key=lambda n: server_order([{"server": s} for s in caps]).index(n)):
        entry = caps[server]
        tried = ", ".join(
            f"{p['rate']:g} → " + (f"{100 * p['goodput_share']:.0f}%"
                                    if isinstance(p.get("goodput_share"), (int, float))
                                    else "client failed")
            for p in sorted(entry.get("points", []), key=lambda p: p["rate"]))
        out.append(f"| {column_name(server)} | {_capacity_cell(entry, 0.9)} | "
                   f"{_capacity_cell(entry, 0.99)} | {tried or '—'} |")
    return out


def _capacity(report: dict[str, Any] | None, server: str) -> tuple[float | None, float | None]:
    """(capacity at >= 90%, the lowest rate that missed it) of ``server`` in ``report``."""
    entry = ((report or {}).get("capacity") or {}).get(server)
    if entry is None:
        return None, None
    cap, miss, _ = _measured(entry, 0.9)
    return cap, miss


def capacity_runs_by_peer(names: list[str], reports: dict[str, dict[str, Any]]
                          ) -> dict[str, str]:
    """For each peer, the latest of ``names`` (runs of one class, oldest first) whose capacity
    sweep has both tailserve and that peer: each ratio comes from one run."""
    runs: dict[str, str] = {}
    for n in names:
        caps = reports[n].get("capacity") or {}
        if "tailserve" in caps:
            runs.update({peer: n for peer in caps if peer != "tailserve"})
    return runs


def targets_table(report: dict[str, Any],
                  cap_reports: dict[str, dict[str, Any]]) -> list[str]:
    """Issues 29, 30 and 33's targets against the peers, read off the class's runs: each with
    tailserve's figure, the peer's, the ratio and whether it is met; a capacity ratio from
    ``cap_reports[peer]``, the peer's run beside tailserve. A target whose figures the runs
    lack is left out."""
    rows = report["rows"]
    # The targets hold tailserve's defaults: in a run of variants, the one named "default".
    default = "tailserve[default]" if any(r["server"] == "tailserve[default]" for r in rows) \
        else "tailserve"

    def fig(server: str, workload: str, key: str) -> float | None:
        return cell(rows, default if server == "tailserve" else server, workload,
                    lambda r: r.get(key))

    lines: list[str] = []

    def add(target: str, ours: float | None, peer: float | None, limit: float,
            higher_is_better: bool = False, digits: int = 1) -> None:
        if ours is None or peer is None or peer <= 0:
            return
        ratio = ours / peer
        met = ratio >= limit if higher_is_better else ratio <= limit
        lines.append(f"| {target} | {fmt(ours, digits)} | {fmt(peer, digits)} | "
                     f"{ratio:.2f}x | {'met' if met else '**not met**'} |")

    add("29: mixed P99 TTFT <= vLLM's", fig("tailserve", "mixed", "p99_ttft_ms"),
        fig("vllm", "mixed", "p99_ttft_ms"), 1.0)
    add("29: mixed P99 ITL <= 1/2 vLLM's", fig("tailserve", "mixed", "p99_itl_ms"),
        fig("vllm", "mixed", "p99_itl_ms"), 0.5)
    add("29: long-mix short TTFT P99 <= 3x P50",
        fig("tailserve", "long-mix", "short_p99_ttft_ms"),
        fig("tailserve", "long-mix", "short_median_ttft_ms"), 3.0)
    for peer, limit in (("vllm", 1.5), ("llama.cpp", 3.0)):
        name = f"29: capacity at SLO >= {limit:g}x {column_name(peer)}'s (req/s)"
        ours, _ = _capacity(cap_reports.get(peer), "tailserve")
        theirs, their_miss = _capacity(cap_reports.get(peer), peer)
        if theirs is None and ours is not None and their_miss:
            # No rate tried met it for the peer: its capacity is below the lowest tried.
            bound = ours / their_miss
            lines.append(f"| {name} | {fmt(ours, 3)} | < {fmt(their_miss, 3)} | > {bound:.2f}x "
                         f"| {'met' if bound >= limit else '**not met**'} |")
        else:
            add(name, ours, theirs, limit, higher_is_better=True, digits=3)
    for n in ("128", "1000", "2000"):
        add(f"30: TTFT of a {int(n):,}-token prompt <= 0.7x vLLM's",
            fig("tailserve", f"prompt{n}", "median_ttft_ms"),
            fig("vllm", f"prompt{n}", "median_ttft_ms"), 0.7)
    add("30: saturated output tok/s >= 1.5x vLLM's", fig("tailserve", "saturated",
        "output_throughput"), fig("vllm", "saturated", "output_throughput"), 1.5,
        higher_is_better=True)
    add("33: structured TTFT P99, constrained <= 1.2x unconstrained",
        fig("tailserve", "structured", "constrained_p99_ttft_ms"),
        fig("tailserve", "structured", "unconstrained_p99_ttft_ms"), 1.2)
    add("33: structured TTFT P99, constrained <= vLLM's constrained",
        fig("tailserve", "structured", "constrained_p99_ttft_ms"),
        fig("vllm", "structured", "constrained_p99_ttft_ms"), 1.0)
    # Already a ratio (constrained / unconstrained in one run): against 1, limit 1.1.
    add("33: structured ITL P50, constrained / unconstrained <= 1.1",
        fig("tailserve", "structured", "p50_itl_constrained_over_unconstrained"), 1.0, 1.1,
        digits=2)
    if not lines:
        return []
    return ["Targets of the issues, read off these runs (issue: target; the second figure is "
            "the peer's, or tailserve's own P50 for the long-mix ratio). Why a target is missed: "
            "[benchmarks/notes/peers.md](../benchmarks/notes/peers.md).", "",
            "| target | tailserve | against | ratio | |", "|---|---:|---:|---:|---|", *lines]


def warning_lines(report: dict[str, Any]) -> list[str]:
    """A run's warnings as a list with a blank line after it (none: nothing)."""
    warnings = report.get("warnings") or []
    return [*(f"- warning: {w}" for w in warnings), ""] if warnings else []


def describe(report: dict[str, Any], name: str) -> str:
    la = (report.get("load_average_before"), report.get("load_average_after"))
    load = "not recorded" if None in la else f"{la[0]} before, {la[1]} after"
    slos = report.get("slos_ms") or {}
    good = (f", goodput SLOs TTFT <= {slos['ttft_ms']:g} ms and no gap > {slos['itl_ms']:g} ms"
            if "ttft_ms" in slos and "itl_ms" in slos else "")
    # A run's A/B rows against an older tree are left off the page (the user's figures are
    # the tree's own); the report says which and where the full one is kept.
    left = f". Rows left out: {report['rows_left_out']}" if report.get("rows_left_out") else ""
    return (f"`{name}`: commit {report.get('commit', 'not recorded')}, "
            f"date {report.get('date', 'not recorded')}, {machine_class(report)}, "
            f"client `{report.get('client', '?')}`, load average {load}{good}{left}")


def render(reports: dict[str, dict[str, Any]],
           real_sizes: dict[str, dict[str, Any]] | None = None) -> str:
    """The page from {file name: report} (and the real-size runs' reports); files sort by
    name, so name them by date."""
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
    capacity_runs: dict[str, list[str]] = {}
    for n in measured:  # the last (latest) run of each class wins
        if reports[n].get("rows"):  # a capacity-only run (--workloads '') has none
            classes[machine_class(reports[n])] = n
        if reports[n].get("capacity"):
            capacity_runs.setdefault(machine_class(reports[n]), []).append(n)
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
        lines += warning_lines(report)
        # The capacity tables: each peer's latest sweep beside tailserve (else the latest
        # sweep), each with its run unless it is the class's table run.
        cap_names = capacity_runs.get(cls, [])
        by_peer = capacity_runs_by_peer(cap_names, reports)
        for cap_name in sorted(set(by_peer.values()) or cap_names[-1:]):
            cap_report = reports[cap_name]
            lines += [*capacity_table(cap_report), ""]
            if cap_name != n:
                lines += [describe(cap_report, cap_name) + ".", "",
                          f"    {command(cap_report)}", ""]
                lines += warning_lines(cap_report)
        targets = targets_table(report, {p: reports[c] for p, c in by_peer.items()})
        if targets:
            lines += [*targets, ""]
    lines += real_sizes_page.section(real_sizes or {})
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
    p.add_argument("--real-sizes", default=str(real_sizes_page.RESULTS),
                   help="directory of benchmarks/real_sizes.py's reports (default: %(default)s)")
    p.add_argument("--out", default=str(PAGE), help="the page (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the page differs from what it would be")
    args = p.parse_args(argv)
    text = render(load_reports(Path(args.results)), load_reports(Path(args.real_sizes)))
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
