"""``tailserve diagnose``: why the tail is what it is.

    run = load_run("result.json", timeline_path=None)
    d = diagnose(run, percentile=99)
    d.as_json()        # {"tail": {...}, "windows": [...], "errors": {...}, "findings": [...]}
    print_summary(d, console)

The steps: fit the step model on the server's step records (stepmodel.py); build per-metric
samples with each cause's raw part (samples.py; the wait for a grammar, grammar.py); split the
tail's excess over the median into shares (attribution.py) with evidence and advice
(advice.py); find the windows where the P99 jumps (windows.py); and say it in a few
sentences.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tailserve.analyze.advice import explain
from tailserve.analyze.attribution import MetricTail, attribute
from tailserve.analyze.contention import CAUSE as CONTENTION
from tailserve.analyze.contention import carve_contention
from tailserve.analyze.counters import counter_samples
from tailserve.analyze.data import RunData
from tailserve.analyze.gpu_memory import gpu_watermark
from tailserve.analyze.gpu_memory import sentences as gpu_sentences
from tailserve.analyze.grammar import GRAMMAR, carve_grammar, explain_grammar
from tailserve.analyze.noisy_neighbour import name_noisy_neighbour
from tailserve.analyze.samples import (
    CLIENT_CAUSES,
    SERVER_CAUSES,
    Samples,
    client_samples,
    server_samples,
)
from tailserve.analyze.slo_misses import SloMisses, print_misses, slo_misses
from tailserve.analyze.span_parts import apply_spans
from tailserve.analyze.stepmodel import StepModel, WindowSums, fit_step_model
from tailserve.analyze.ttft_parts import decompose_ttft
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
    # cause -> why the engine could not show it and what would let it be judged
    cannot_why: dict[str, str] = field(default_factory=dict)
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
            "cannot_judge_why": self.cannot_why,
            "engine": self.run.engine.as_json() | {"version": self.run.engine_version},
            "load": load_phrase(self.run),
            "ttft_decomposition": decompose_ttft(self),
            "notes": self.run.notes,
            "gpu_memory": gpu_watermark(self.run),
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
        carve_grammar(samples, run)
        judged = (*SERVER_CAUSES, GRAMMAR) if ws is not None else (
            "queueing", "own_prefill", "preemption", "client_or_network", GRAMMAR)
    elif run.series is not None:
        samples = counter_samples(run)
        judged = _judged_by_signals(run)
    else:
        samples = client_samples(run)
        judged = CLIENT_CAUSES if run.start_time is not None else ("own_prefill",)
    if not run.has_timing and run.has_spans and apply_spans(run, samples):
        # vLLM's request spans: the server's own TTFT, so the client's time is judged too.
        judged = (*judged, "client_or_network")
    judged = tuple(c for c in judged if c != CONTENTION)
    if carve_contention(samples, run):  # the host's CPU, when bench ran beside the server
        judged = (*judged, CONTENTION)
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
            if cs.cause == GRAMMAR:
                explain_grammar(cs, run, s, mt.tail)
        tails[m] = mt
    errors = dict(Counter(q.error_type or "error" for q in run.requests if not q.ok))
    name_noisy_neighbour(run, samples, tails)  # tenants (docs/tenants.md)
    d = Diagnosis(run, percentile, model, samples, tails, find_windows(run, samples), errors,
                  cannot, slo=slo_misses(run, samples, slos_ms),
                  cannot_why={c: _why_not(run, c) for c in cannot})
    d.findings = _findings(d)
    return d


def _judged_by_signals(run: RunData) -> tuple[str, ...]:
    """The client's causes, and those the engine's recorded gauges and counters support."""
    sr, e = run.series, run.engine
    judged = list(CLIENT_CAUSES)
    if sr is not None and e.judges("kv_cache_pressure") and sr.has("waiting") and (
            sr.has("kv_usage") or sr.has("kv_usage_old")):
        judged.append("kv_cache_pressure")
    if sr is not None and e.judges("preemption") and "preemptions" in sr.delta:
        judged.append("preemption")
    return tuple(judged)


def _why_not(run: RunData, cause: str) -> str:
    from tailserve.analyze.engines import OTHER

    if cause == CONTENTION:
        return run.host_cpu_why_not or (
            "the bench recorded no CPU samples of the server's host (a result from before "
            "bench read /proc, or --no-observe): run bench on the server's host")
    if run.has_timing:
        return "the result has no server step timeline (bench --no-observe, or no " \
            "/debug/timeline): record it, or pass --timeline"
    if cause in run.engine.missing:
        return run.engine.missing[cause]
    if run.series is None and run.engine.family != "other":
        return (f"the bench recorded no /metrics samples from {run.engine.name} "
                "(--no-observe, or /metrics was off)")
    if run.series is not None:
        return f"the signals it rests on were not in {run.engine.name}'s recorded /metrics"
    return OTHER.missing.get(cause, "not recorded")


def load_phrase(run: RunData) -> str:
    """How the load was offered: "at 4 req/s", "all at once", "8 at a time"."""
    if run.max_concurrency is not None:
        return "one at a time" if run.max_concurrency == 1 else \
            f"{run.max_concurrency} at a time"
    rate = run.request_rate
    if rate is None:
        return ""
    return "all at once" if rate == float("inf") else f"at {rate:g} req/s"


def headline(d: Diagnosis) -> str:
    """"50 requests to vLLM 0.32.0 at 4 req/s"."""
    n = len(d.run.requests)
    if d.run.source == "vllm result":
        return f"{n} requests from vLLM's bench client (no send times)"
    load = load_phrase(d.run)
    return f"{n} requests to {d.run.engine_label}" + (f" {load}" if load else "")


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
    # What the engine does not show comes first; the host's CPU is not the engine's to show
    # (it takes bench on the server's host), so that one is said last.
    engine_cannot = [c for c in d.cannot_judge if c != CONTENTION]
    if engine_cannot:
        whys = "; ".join(f"{c}: {d.cannot_why.get(c, 'not recorded')}" for c in engine_cannot)
        out.append(f"Cannot judge {', '.join(engine_cannot)} from what "
                   f"{d.run.engine_label} exposed ({whys}).")
    for m, t in d.tails.items():
        top = t.causes[0] if t.causes else None
        head = (f"{NAMES[m]}: P50 {t.p50_s * 1e3:.1f} ms, P{t.percentile:g} "
                f"{t.threshold_s * 1e3:.1f} ms")
        if top is None:
            out.append(f"{head}; the causes tailserve knows explain none of the tail.")
        elif top.cause == "none":
            out.append(f"{head}: none; {t.none_reason or top.advice}")
        else:
            rest = ", ".join(f"{c.cause} {c.share:.0%}" for c in t.causes[1:3])
            out.append(f"{head}: {top.share:.0%} of the tail is {top.cause}"
                       + (f" (then {rest})" if rest else "") + f". {top.advice}")
    for w in d.windows[:5]:
        out.append(f"P99 jump at {w['summary']}.")
    out += gpu_sentences(gpu_watermark(d.run))
    if CONTENTION in d.cannot_judge:
        out.append(f"Cannot judge {CONTENTION}: {d.cannot_why.get(CONTENTION, 'not recorded')}.")
    if d.errors:
        total = sum(d.errors.values())
        kinds = ", ".join(f"{k} ×{v}" for k, v in sorted(d.errors.items(), key=lambda x: -x[1]))
        out.append(f"{total} of {len(d.run.requests)} requests failed ({kinds}); failed "
                   "requests are not in the latency figures.")
    return out


def print_summary(d: Diagnosis, console: Any) -> None:
    from rich.table import Table

    console.print(f"[bold]tailserve diagnose[/]: {headline(d)}; the tail is every sample at "
                  f"or above P{d.percentile:g}")
    for note in d.run.notes:
        console.print(f"[dim]{note}[/]")
    sr = d.run.series
    if sr is not None:
        read = [d.run.engine.signals[k].metric for k in d.run.engine.signals if sr.has(k)]
        console.print(f"{d.run.engine.name}'s /metrics: {len(sr)} samples "
                      f"{(sr.t[-1] - sr.t[0]) / max(len(sr) - 1, 1):.1f} s apart; read "
                      + ", ".join(read))
    if d.run.has_spans:
        n = sum(q.span is not None for q in d.run.requests)
        console.print(f"vLLM's llm_request spans: {n} of {len(d.run.requests)} requests "
                      "(queue, prefill and server-side TTFT per request)")
    wm = gpu_watermark(d.run)
    for dev in (wm or {}).get("devices") or []:
        console.print(f"GPU {dev['index']} memory (NVML, this host): peak "
                      f"{dev['peak_used_fraction']:.0%} of {dev['total_bytes'] / 2**30:.0f} GiB "
                      f"at t={dev['peak_at_s']:g} s (started at {dev['first_used_fraction']:.0%})")
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
                      f"{t.p99_s * 1e3:.2f} ms · {len(t.tail)} tail samples · named above "
                      f"{max(t.noise_s, t.floor_s) * 1e3:.1f} ms per tail sample (run's noise "
                      f"{t.noise_s * 1e3:.1f} ms, floor {t.floor_s * 1e3:g} ms)",
                      title_justify="left", show_lines=False)
        table.add_column("cause")
        table.add_column("share", justify="right")
        table.add_column("evidence", overflow="fold")
        table.add_column("advice", overflow="fold")
        for c in t.causes:
            basis = f"\n[dim]from {c.basis}[/]" if c.basis else ""
            table.add_row(c.cause, f"{c.share:.0%}", c.text + basis, c.advice)
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
