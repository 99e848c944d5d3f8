"""``tailserve diagnose``: why the tail is what it is.

    run = load_run("result.json", timeline_path=None)
    d = diagnose(run, percentile=99)
    d.as_json()        # {"tail": {...}, "windows": [...], "errors": {...}, "findings": [...]}
    print_summary(d, console)

The steps: fit the step model on the server's step records (stepmodel.py); build per-metric
samples with each cause's raw part (samples.py); split the tail's excess over the median into
shares (attribution.py) with evidence and advice (advice.py); find the windows where the P99
jumps (windows.py); and say it in a few sentences.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tailserve.analyze.advice import explain
from tailserve.analyze.attribution import MetricTail, attribute
from tailserve.analyze.data import RunData
from tailserve.analyze.noisy_neighbour import name_noisy_neighbour
from tailserve.analyze.samples import (
    CLIENT_CAUSES,
    SERVER_CAUSES,
    Samples,
    client_samples,
    server_samples,
)
from tailserve.analyze.slo_misses import SloMisses, print_misses, slo_misses
from tailserve.analyze.stepmodel import StepModel, WindowSums, fit_step_model
from tailserve.analyze.windows import find_windows

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
MIN_STEPS_FOR_FIT = 8


@dataclass
class Diagnosis:
    run: RunData
    percentile: float
    model: StepModel | None
    samples: dict[str, Samples]
    tails: dict[str, MetricTail]
    windows: list[dict[str, Any]]
    errors: dict[str, int]
    cannot_judge: list[str]
    findings: list[str] = field(default_factory=list)
    replicas: list[dict[str, Any]] | None = None  # per-replica breakdown (analyze/replicas.py)
    slo: SloMisses | None = None  # which requests missed which SLO, and why

    def as_json(self) -> dict[str, Any]:
        extra = {} if self.replicas is None else {"replicas": self.replicas}
        return extra | {
            "slo": None if self.slo is None else self.slo.as_json(),
            "tail": {m: t.as_json() for m, t in self.tails.items()},
            "windows": self.windows,
            "errors": self.errors,
            "findings": self.findings,
            "source": self.run.source,
            "percentile": self.percentile,
            "num_requests": len(self.run.requests),
            "step_model": self.model.describe() if self.model is not None else None,
            "cannot_judge": self.cannot_judge,
        }


def diagnose(run: RunData, percentile: float = 99.0,
             slos_ms: dict[str, float] | None = None) -> Diagnosis:
    """``slos_ms``: SLOs to judge every request by (kind -> ms); None: the ones the bench run
    judged, else each request's own from the server's timing (analyze/slo_misses.py)."""
    if not 0 < percentile < 100:
        raise ValueError(f"--percentile must be between 0 and 100, got {percentile}")
    if run.replicas:
        d = _diagnose_replicas(run, percentile)
        d.slo = slo_misses(run, d.samples, slos_ms)
        if d.slo is not None:
            d.findings.insert(0, d.slo.sentence())
        return d
    model = None
    if run.steps is not None and len(run.steps) >= MIN_STEPS_FOR_FIT:
        model = fit_step_model(run.steps)
    judged: tuple[str, ...]
    if run.has_timing:
        ws = WindowSums(run.steps, model) if run.steps is not None else None
        samples = server_samples(run, model, ws)
        judged = SERVER_CAUSES if ws is not None else (
            "queueing", "own_prefill", "preemption", "client_or_network")
    else:
        samples = client_samples(run)
        judged = CLIENT_CAUSES if run.start_time is not None else ("own_prefill",)
    cannot = [c for c in SERVER_CAUSES if c not in judged]
    tails: dict[str, MetricTail] = {}
    for m in METRICS:
        s = samples.get(m)
        if s is None or len(s.values) == 0:
            continue
        for c in [c for c in s.parts if c not in judged]:
            del s.parts[c]
        mt = attribute(s, percentile, cannot)
        if mt is None:
            continue
        for cs in mt.causes:
            explain(cs, mt, s, run, model)
        tails[m] = mt
    errors = dict(Counter(q.error_type or "error" for q in run.requests if not q.ok))
    name_noisy_neighbour(run, samples, tails)  # tenants (docs/tenants.md)
    d = Diagnosis(run, percentile, model, samples, tails, find_windows(run, samples), errors,
                  cannot, slo=slo_misses(run, samples, slos_ms))
    d.findings = _findings(d)
    return d


def _diagnose_replicas(run: RunData, percentile: float) -> Diagnosis:
    from tailserve.analyze.replicas import findings, judge

    samples, tails, model, cannot = judge(run, percentile)
    errors = dict(Counter(q.error_type or "error" for q in run.requests if not q.ok))
    d = Diagnosis(run, percentile, model, samples, tails, find_windows(run, samples), errors,
                  cannot, replicas=[r.breakdown for r in run.replicas or []])
    d.findings = findings(run, tails) + _findings(d)
    return d


def _findings(d: Diagnosis) -> list[str]:
    out = [] if d.slo is None else [d.slo.sentence()]
    if d.cannot_judge:
        why = ("the result has no server timing (not a tailserve server)"
               if not d.run.has_timing else "the result has no server step timeline")
        out.append(f"Cannot judge {', '.join(d.cannot_judge)}: {why}; only the causes the "
                   "client's own measurements support are named.")
    for m, t in d.tails.items():
        top = t.causes[0] if t.causes else None
        head = (f"{NAMES[m]}: P50 {t.p50_s * 1e3:.1f} ms, P{t.percentile:g} "
                f"{t.threshold_s * 1e3:.1f} ms")
        if top is None:
            out.append(f"{head}; the causes tailserve knows explain none of the tail.")
        elif top.cause == "none":
            out.append(f"{head}: none — {top.advice}")
        else:
            rest = ", ".join(f"{c.cause} {c.share:.0%}" for c in t.causes[1:3])
            out.append(f"{head}: {top.share:.0%} of the tail is {top.cause}"
                       + (f" (then {rest})" if rest else "") + f". {top.advice}")
    for w in d.windows[:5]:
        out.append(f"P99 jump at {w['summary']}.")
    if d.errors:
        total = sum(d.errors.values())
        kinds = ", ".join(f"{k} ×{v}" for k, v in sorted(d.errors.items(), key=lambda x: -x[1]))
        out.append(f"{total} of {len(d.run.requests)} requests failed ({kinds}); failed "
                   "requests are not in the latency figures.")
    return out


def print_summary(d: Diagnosis, console: Any) -> None:
    from rich.table import Table

    console.print(f"[bold]tailserve diagnose[/]: {len(d.run.requests)} requests from a "
                  f"{d.run.source}, tail = samples at or above P{d.percentile:g}")
    if d.model is not None:
        m = d.model.describe()
        console.print(f"step model: {m['base_ms']:.2f} ms + {m['ms_per_decode_seq']:.3f} ms/"
                      f"decode seq + {m['ms_per_1k_prefill_tokens']:.2f} ms/1k prefill tokens "
                      f"(R² {m['r2']:.2f})")
    for metric, t in d.tails.items():
        if [c.cause for c in t.causes] == ["none"]:
            console.print(f"[bold]{NAMES[metric]}[/]  P50 {t.p50_s * 1e3:.2f} ms · P99 "
                          f"{t.p99_s * 1e3:.2f} ms · none: {t.causes[0].advice}")
            continue
        table = Table(title=f"{NAMES[metric]}  P50 {t.p50_s * 1e3:.2f} ms · P99 "
                      f"{t.p99_s * 1e3:.2f} ms · {len(t.tail)} tail samples",
                      title_justify="left", show_lines=False)
        table.add_column("cause")
        table.add_column("share", justify="right")
        table.add_column("evidence", overflow="fold")
        table.add_column("advice", overflow="fold")
        for c in t.causes:
            ev = ", ".join(f"{k}={v}" for k, v in c.evidence.items())
            table.add_row(c.cause, f"{c.share:.0%}", ev, c.advice)
        if t.unexplained_share >= 0.05 and t.causes and t.causes[0].cause != "none":
            table.add_row("[dim](unexplained)[/]", f"{t.unexplained_share:.0%}",
                          "longer outputs, bigger batches, or a cause not recorded", "")
        console.print(table)
    if d.slo is not None:
        print_misses(d.slo, console)
    if d.windows:
        console.print("[bold]windows where the P99 jumps[/]")
        for w in d.windows:
            console.print(f"  {w['summary']}")
    if d.replicas:
        _print_replicas(d.replicas, console)
    console.print("[bold]findings[/]")
    for f in d.findings:
        console.print(f"  • {f}")


def _print_replicas(rows: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    table = Table(title="replicas", title_justify="left")
    for col in ("replica", "requests", "TTFT P50/P99 ms", "ITL P50/P99 ms", "step P50/P99 ms",
                "queue P99 ms", "max waiting", "busy", "slowness"):
        table.add_column(col, justify="left" if col == "replica" else "right")
    for r in rows:
        slow = "-" if r["slowness"] is None else f"{r['slowness']:.2f}x"
        table.add_row(r["url"] + ("" if r["healthy"] else " (unhealthy)"),
                      f"{r['num_requests']} ({r['share_of_requests']:.0%})",
                      f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])}",
                      f"{ms(r['itl_p50_ms'])} / {ms(r['itl_p99_ms'])}",
                      f"{ms(r['step_p50_ms'])} / {ms(r['step_p99_ms'])}",
                      ms(r["queue_p99_ms"]), str(r["max_waiting"]), f"{r['busy_share']:.0%}",
                      slow)
    console.print(table)
