"""Reading a serving_peers.py report's rows into table cells, for the pages rendered from
the reports (performance_page.py for the bundled model, real_sizes_page.py for the real-size
runs): the servers as columns in the page's order, their column names, one figure's median
over rounds, its formatting, and the command a run came from."""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Callable, Iterable
from typing import Any

# Column of each server the harness names, in the page's order; tailserve variants
# ("tailserve[LABEL]") follow tailserve, unknown servers come last under their own name.
COLUMNS = {"tailserve": "tailserve", "vllm": "vLLM-CPU", "llama.cpp": "llama-server"}


def fmt(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def median(values: Iterable[Any]) -> float | None:
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


def cell(rows: list[dict[str, Any]], server: str, workload: str,
         get: Callable[[dict[str, Any]], Any]) -> float | None:
    """The median over rounds of one figure of one server on one workload."""
    return median(get(r) for r in rows
                  if r["server"] == server and r["workload"] == workload and "error" not in r)


def command_line(script: str, report: dict[str, Any]) -> str | None:
    """The command a report's run was given, from the repository root, each argument
    shell-quoted so the line can be pasted (an empty ``--workloads ''`` stays an argument);
    None where the report did not record its argv."""
    argv = [str(a) for a in report.get("argv", [])]
    if not argv:
        return None
    return " ".join([f"python benchmarks/{script}", *(shlex.quote(a) for a in argv[1:])])
