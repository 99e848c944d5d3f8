"""The "Real sizes" section of docs/performance.md, from benchmarks/real_sizes.py's reports in
benchmarks/results/real_sizes/: one table per measured run (newest first by date), the model's
shape and format, each server's headline figure per workload (TPOT against the stored-bytes
roofline, TTFT of the long and short prompts, saturated output tok/s), with the run's commit,
date, machine, load and command. performance_page.py renders it after the bundled model's
tables; smoke runs are left out (their figures measure nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from report_cells import cell, column_name, command_line, fmt, server_order

RESULTS = Path(__file__).resolve().parent / "results" / "real_sizes"

INTRO = """\
## Real sizes: Llama 3.x shapes on random weights

`benchmarks/real_sizes.py` writes checkpoints with the published shapes of Llama-3.2-1B,
Llama-3.2-3B and Llama-3.1-8B (random weights; GGUF via the `gguf` package or `llama-quantize`,
bf16 safetensors for vLLM) and runs `benchmarks/serving_peers.py` on them, `tailserve bench` as
the one client. **Timings on random weights with `ignore_eos` are real timings:** a decode step
reads every stored byte whatever the values, a prefill multiplies the same shapes, and every
request is exactly as long as asked. What differs from the trained checkpoints (the tokenizer,
no rope scaling) changes no byte a step reads;
[benchmarks/notes/real_sizes.md](../benchmarks/notes/real_sizes.md) says why and has each run's
reading. `tailserve[amx-bf16]` is the opt-in level
(`TAILSERVE_QUANT_ISA=amx-bf16`; not VNNI's answers); `tailserve[amx]` the default on a CPU
with AMX. Latencies in milliseconds; — where a run has no such figure.
"""


def _single(rows: list[dict[str, Any]], server: str) -> str:
    tpot = cell(rows, server, "single", lambda r: r.get("median_tpot_ms"))
    ratio = cell(rows, server, "single", lambda r: r.get("tpot_over_roofline"))
    if tpot is None:
        return "—"
    return fmt(tpot, 1) + (f" ({ratio:.2f}x roofline)" if ratio is not None else "")


def _plain(key: str, workload: str) -> Callable[[list[dict[str, Any]], str], str]:
    def plain(rows: list[dict[str, Any]], server: str) -> str:
        return fmt(cell(rows, server, workload, lambda r: r.get(key)), 1)
    return plain


def _lines(workload: str) -> tuple[str, Callable[[list[dict[str, Any]], str], str]]:
    if workload == "single":
        return "single: TPOT P50 (x the stored-bytes roofline)", _single
    if workload == "saturated":
        return "saturated: output tok/s", _plain("output_throughput", workload)
    if workload.startswith("prompt"):
        return f"{workload}: TTFT P50", _plain("median_ttft_ms", workload)
    return f"{workload}: TTFT P99", _plain("p99_ttft_ms", workload)


def run_table(name: str, report: dict[str, Any]) -> list[str]:
    """One run: a heading naming the model, then workloads x servers."""
    rows = report.get("rows", [])
    servers = server_order(rows)
    workloads = list(dict.fromkeys(str(r.get("workload")) for r in rows))
    m = report.get("machine", {})
    la, lb = report.get("load_average_before"), report.get("load_average_after")
    load = f"load {la[0]} before, {lb[0]} after" if la and lb else "load not recorded"
    model = report.get("model", {}).get("name", name)
    out = [f"### {model}: {m.get('cpu', 'unknown CPU')}, {m.get('cpus', '?')} cores, "
           f"{report.get('date', 'date not recorded')}", "",
           f"`{name}`: commit {report.get('commit', 'not recorded')}, {load}.", "",
           "| workload | " + " | ".join(column_name(s) for s in servers) + " |",
           "|---|" + "---:|" * len(servers)]
    for w in workloads:
        label, figure = _lines(w)
        out.append(f"| {label} | " + " | ".join(figure(rows, s) for s in servers) + " |")
    cmd = command_line("real_sizes.py", report)
    if cmd:  # the run as given (a variant's own flags, such as --slo-itl-ms none, show here)
        out += ["", f"    {cmd}"]
    return out


def section(reports: dict[str, dict[str, Any]]) -> list[str]:
    """The section's lines, newest run first (by its date, then file name); none without a
    measured run."""
    measured = sorted((n for n, r in reports.items() if not r.get("smoke") and r.get("rows")),
                      key=lambda n: (str(reports[n].get("date", "")), n), reverse=True)
    if not measured:
        return []
    lines = [INTRO]
    for n in measured:
        lines += [*run_table(n, reports[n]), ""]
    return lines
