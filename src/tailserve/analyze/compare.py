"""``tailserve compare``: did B change the latency of A, and by how much, with what certainty?

For each metric (TTFT, TPOT, ITL, E2EL) both sides' P50 and tail percentile, the difference
B − A with a bootstrap confidence interval, a Mann-Whitney U p-value and a verdict; with SLOs
(given, or the ones the runs were judged by) the goodput share too, and for two ``bench
--sweep`` summaries the capacity (analyze/compare_goodput.py). The exit status gates CI: 1
when some metric's tail is, with the chosen confidence, worse by more than ``--threshold``
percent, or the goodput share or a capacity is worse beyond it, else 0.

What is resampled matters. Requests of one run share the server's state (batch, queue, cache),
so they are not independent, and a run-to-run difference (another machine's noise, a warmer
cache) is invisible to resampling within one run. With replicates on both sides (at least two
runs each) whole runs are resampled, which covers run-to-run variation; otherwise requests
within the run are, and the output says so. ITL gaps are resampled with their request (a
request's gaps were decoded in the same batches), never one by one.

The verdict is the bootstrap interval of the tail difference: "worse" when it lies above 0,
"better" below 0. The Mann-Whitney test asks a different question (does one side tend to be
slower anywhere in the distribution) over one value per request; it is reported beside, not
used for the verdict, because a tail-only regression need not move it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.bootstrap import GroupedSample, bootstrap_percentiles, percentile_interval
from tailserve.analyze.compare_goodput import (
    GoodputComparison,
    compare_goodput,
    file_slos,
    render_slo_gates,
    request_record,
)

METRICS = ("ttft", "tpot", "itl", "e2el")
WORSE, BETTER, SAME = "worse", "better", "no significant difference"


class CompareError(ValueError):
    """A file or option the user can fix; the CLI prints it and exits 2."""


@dataclass
class RunSamples:
    """One result file's successful requests, in milliseconds, one list per request."""

    path: str
    label: str
    values: dict[str, list[list[float]]]  # metric -> per request (scalar metrics: 0 or 1 item)
    num_requests: int
    num_failed: int
    notes: list[str] = field(default_factory=list)
    # For the goodput gate: every request (failed ones too) as compare_goodput reads it, and
    # the SLOs the bench judged the run by.
    requests: list[dict[str, Any]] = field(default_factory=list)
    slos_ms: dict[str, float] | None = None


@dataclass(frozen=True)
class CompareOptions:
    metrics: tuple[str, ...] = METRICS
    percentile: float = 99.0
    confidence: float = 0.95
    threshold_pct: float = 0.0
    num_resamples: int = 2000
    seed: int = 0
    slos_ms: dict[str, float] | None = None  # the goodput gate's SLOs (None: the runs' own)

    def __post_init__(self) -> None:
        bad = [m for m in self.metrics if m not in METRICS]
        if bad or not self.metrics:
            raise CompareError(f"--metric wants some of {','.join(METRICS)}; got "
                               f"{','.join(self.metrics) or 'nothing'}")
        if not 0 < self.percentile < 100:
            raise CompareError(f"--percentile must be in (0, 100), got {self.percentile}")
        if not 0 < self.confidence < 1:
            raise CompareError(f"--confidence must be in (0, 1), got {self.confidence}")
        if self.threshold_pct < 0:
            raise CompareError(f"--threshold is a percentage >= 0, got {self.threshold_pct}")
        if self.num_resamples < 100:
            raise CompareError(f"--resamples must be >= 100, got {self.num_resamples}")


@dataclass(frozen=True)
class Difference:
    """B − A at one percentile: milliseconds and percent of A, each with its interval."""

    ms: float
    ci_ms: tuple[float, float]
    pct: float
    ci_pct: tuple[float, float]


@dataclass(frozen=True)
class MetricComparison:
    metric: str
    n_a: int  # values (requests; ITL: gaps)
    n_b: int
    a_ms: dict[float, float]  # percentile -> value
    b_ms: dict[float, float]
    diff: dict[float, Difference]
    p_value: float
    verdict: str
    gate_failed: bool


@dataclass
class Comparison:
    options: CompareOptions
    unit: str  # "requests" | "runs": what the bootstrap resamples
    a: list[RunSamples]
    b: list[RunSamples]
    metrics: list[MetricComparison]
    notes: list[str]
    goodput: GoodputComparison | None = None

    @property
    def passed(self) -> bool:
        return not any(m.gate_failed for m in self.metrics) and not (
            self.goodput is not None and self.goodput.gate_failed)


def load_run(path: str) -> RunSamples:
    """A ``tailserve bench --save-result`` step file, or vLLM's ``--save-detailed`` result."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as exc:
        raise CompareError(f"cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise CompareError(f"{path} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CompareError(f"{path} is not a bench result (a JSON object)")
    if "steps" in obj and "tailserve" not in obj:
        files = ", ".join(str(s.get("result_file")) for s in obj["steps"])
        raise CompareError(f"{path} is the summary of a multi-step run; compare one step's "
                           f"file: {files}")
    label = str(obj.get("label") or os.path.basename(path))
    records = (obj.get("tailserve") or {}).get("requests")
    if isinstance(records, list):
        run = _from_records(path, label, records)
        run.slos_ms = file_slos(obj)
        return run
    if isinstance(obj.get("ttfts"), list) and isinstance(obj.get("itls"), list):
        return _from_vllm(path, label, obj)
    raise CompareError(f"{path} has no per-request data: save it with tailserve bench "
                       "--save-result (or vLLM's bench serve --save-detailed)")


def _from_records(path: str, label: str, records: list[dict[str, Any]]) -> RunSamples:
    values: dict[str, list[list[float]]] = {m: [] for m in METRICS}
    failed = 0
    requests = []
    for r in records:
        ok = r.get("error_type") is None and r.get("send_s") is not None
        requests.append(request_record(ok, r.get("ttft_s"), r.get("itl_s") or [],
                                       r.get("output_tokens"), r.get("e2el_s"),
                                       r.get("server_timing")))
        if not ok:
            failed += 1
            continue
        ttft, e2el, out = r.get("ttft_s"), r.get("e2el_s"), r.get("output_tokens")
        values["ttft"].append([] if ttft is None else [1e3 * ttft])
        values["e2el"].append([] if e2el is None else [1e3 * e2el])
        # TPOT as bench/metrics.py defines it: only requests with more than one token.
        if ttft is not None and e2el is not None and out is not None and out > 1:
            values["tpot"].append([1e3 * (e2el - ttft) / (out - 1)])
        else:
            values["tpot"].append([])
        values["itl"].append([1e3 * g for g in r.get("itl_s") or []])
    return RunSamples(path, label, values, len(records), failed, requests=requests)


def _from_vllm(path: str, label: str, obj: dict[str, Any]) -> RunSamples:
    """vLLM's detailed lists hold no E2EL: it is rebuilt as TTFT + the gaps, which is when
    the last chunk arrived (the end of the stream comes a read later, if at all)."""
    values: dict[str, list[list[float]]] = {m: [] for m in METRICS}
    errors = obj.get("errors") or [""] * len(obj["ttfts"])
    outs = obj.get("output_lens") or [0] * len(obj["ttfts"])
    failed = 0
    requests = []
    for ttft, itls, err, out in zip(obj["ttfts"], obj["itls"], errors, outs, strict=False):
        requests.append(request_record(not err, None if err else ttft, list(itls), out,
                                       None if err else ttft + sum(itls), None))
        if err:
            failed += 1
            continue
        e2el = ttft + sum(itls)
        values["ttft"].append([1e3 * ttft])
        values["e2el"].append([1e3 * e2el])
        values["tpot"].append([1e3 * (e2el - ttft) / (out - 1)] if out > 1 else [])
        values["itl"].append([1e3 * g for g in itls])
    return RunSamples(path, label, values, len(obj["ttfts"]), failed,
                      notes=[f"{os.path.basename(path)}: vLLM result; E2EL rebuilt as TTFT + "
                             "the gaps"], requests=requests)


def compare_runs(a: list[RunSamples], b: list[RunSamples],
                 opts: CompareOptions | None = None) -> Comparison:
    """Compare side A (one run, or replicates) with side B."""
    opts = opts or CompareOptions()
    if not a or not b:
        raise CompareError("compare needs at least one run on each side")
    notes = [n for run in a + b for n in run.notes]
    unit = "runs" if len(a) >= 2 and len(b) >= 2 else "requests"
    if unit == "requests" and len(a) + len(b) > 2:
        notes.append("replicates on one side only: requests are resampled (pooled over that "
                     "side's runs); give at least two runs per side to resample whole runs")
    if unit == "runs" and min(len(a), len(b)) < 5:
        notes.append(f"{len(a)} vs {len(b)} runs: a bootstrap over so few runs has few "
                     "distinct resamples, so the interval is coarse and tends to be too narrow; "
                     "5+ runs per side make it trustworthy")
    for side, runs in (("A", a), ("B", b)):
        done = sum(r.num_requests - r.num_failed for r in runs)
        failed = sum(r.num_failed for r in runs)
        if done == 0:
            raise CompareError(f"side {side} ({runs[0].path}) has no successful request")
        if failed:
            notes.append(f"side {side}: {failed} of {done + failed} requests failed and are "
                         "not in the latencies")
    rng = np.random.default_rng(opts.seed)
    qs = sorted({50.0, opts.percentile})
    results = []
    for metric in opts.metrics:
        sa, sb = _sample(a, metric, unit), _sample(b, metric, unit)
        if sa.values.size == 0 or sb.values.size == 0:
            notes.append(f"{metric}: no values on side {'A' if sa.values.size == 0 else 'B'} "
                         "(ITL and TPOT need requests with 2+ output tokens); skipped")
            continue
        results.append(_compare_metric(metric, sa, sb, _per_request(a, metric),
                                       _per_request(b, metric), qs, opts, rng))
    good = compare_goodput([r.requests for r in a], [r.requests for r in b], opts.slos_ms,
                           a[0].slos_ms, unit, opts.confidence, opts.threshold_pct,
                           opts.num_resamples, rng)
    if good is not None and good.source == "A's bench run" and b[0].slos_ms != a[0].slos_ms:
        notes.append(f"B's run was judged by other SLOs ({b[0].slos_ms}); both sides are "
                     f"judged here by A's ({a[0].slos_ms})")
    return Comparison(opts, unit, a, b, results, notes, good)


def _sample(runs: list[RunSamples], metric: str, unit: str) -> GroupedSample:
    if unit == "runs":
        return GroupedSample.from_lists([[v for req in r.values[metric] for v in req]
                                         for r in runs])
    return GroupedSample.from_lists([req for r in runs for req in r.values[metric]])


def _per_request(runs: list[RunSamples], metric: str) -> np.ndarray:
    """One value per request for the rank test: a request's ITL gaps as their mean, since
    counting 100 gaps of one request as 100 independent observations would overstate the
    evidence."""
    reqs = [req for r in runs for req in r.values[metric] if req]
    if not reqs:
        return np.zeros(0)
    lengths = np.array([len(req) for req in reqs])
    flat = np.fromiter((v for req in reqs for v in req), dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.add.reduceat(flat, starts) / lengths


def _compare_metric(metric: str, sa: GroupedSample, sb: GroupedSample, ra: np.ndarray,
                    rb: np.ndarray, qs: list[float], opts: CompareOptions,
                    rng: np.random.Generator) -> MetricComparison:
    from scipy.stats import mannwhitneyu

    point_a = np.percentile(sa.values, qs)
    point_b = np.percentile(sb.values, qs)
    boot_a = bootstrap_percentiles(sa, qs, opts.num_resamples, rng)  # [R, len(qs)]
    boot_b = bootstrap_percentiles(sb, qs, opts.num_resamples, rng)
    diff: dict[float, Difference] = {}
    for k, q in enumerate(qs):
        d = boot_b[:, k] - boot_a[:, k]
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = 100.0 * d / boot_a[:, k]
            pct = 100.0 * (point_b[k] - point_a[k]) / point_a[k] if point_a[k] else np.nan
        diff[q] = Difference(float(point_b[k] - point_a[k]),
                             percentile_interval(d, opts.confidence), float(pct),
                             percentile_interval(rel, opts.confidence))
    tail = diff[opts.percentile]
    verdict = WORSE if tail.ci_ms[0] > 0 else BETTER if tail.ci_ms[1] < 0 else SAME
    # The gate: confident that B's tail is worse by more than the threshold. A NaN bound
    # (A's tail is 0 ms) compares False, so it never fails the gate on its own.
    gate_failed = verdict == WORSE and bool(tail.ci_pct[0] > opts.threshold_pct)
    p = (float(mannwhitneyu(ra, rb, alternative="two-sided").pvalue)
         if len(ra) and len(rb) else float("nan"))
    return MetricComparison(metric, len(sa.values), len(sb.values),
                            dict(zip(qs, map(float, point_a), strict=True)),
                            dict(zip(qs, map(float, point_b), strict=True)),
                            diff, p, verdict, gate_failed)


def _pw(q: float) -> str:
    return str(int(q)) if int(q) == q else str(q)


def to_json(c: Comparison) -> dict[str, Any]:
    o = c.options

    def side(runs: list[RunSamples]) -> dict[str, Any]:
        return {"files": [r.path for r in runs], "labels": [r.label for r in runs],
                "num_requests": sum(r.num_requests for r in runs),
                "num_failed": sum(r.num_failed for r in runs)}

    metrics = {}
    for m in c.metrics:
        metrics[m.metric] = {
            "a": {"n": m.n_a, **{f"p{_pw(q)}_ms": v for q, v in m.a_ms.items()}},
            "b": {"n": m.n_b, **{f"p{_pw(q)}_ms": v for q, v in m.b_ms.items()}},
            "diff": {f"p{_pw(q)}": {"ms": d.ms, "ci_ms": list(d.ci_ms), "pct": d.pct,
                                    "ci_pct": list(d.ci_pct)} for q, d in m.diff.items()},
            "mann_whitney_p": m.p_value,
            "verdict": m.verdict,
            "gate": "fail" if m.gate_failed else "pass",
        }
    return {
        "a": side(c.a), "b": side(c.b),
        "resampling": c.unit,
        "percentile": o.percentile, "confidence": o.confidence,
        "threshold_pct": o.threshold_pct, "num_resamples": o.num_resamples, "seed": o.seed,
        "metrics": metrics,
        "goodput": None if c.goodput is None else c.goodput.as_json(),
        "passed": c.passed,
        "notes": c.notes,
    }


def render(c: Comparison, console: Any) -> None:
    from rich.table import Table

    o = c.options
    p = _pw(o.percentile)
    conf = f"{100 * o.confidence:g}%"
    a_name = c.a[0].label + (f" (+{len(c.a) - 1} replicates)" if len(c.a) > 1 else "")
    b_name = c.b[0].label + (f" (+{len(c.b) - 1} replicates)" if len(c.b) > 1 else "")
    how = ("whole runs resampled" if c.unit == "runs"
           else "requests resampled within each run (they share the server's state, so the "
                "interval is optimistic about run-to-run variation)")
    t = Table(title=f"A = {a_name}   B = {b_name}", title_justify="left",
              caption=f"Δ = B − A at P{p}, {conf} bootstrap interval ({o.num_resamples} "
                      f"resamples, {how}); p: Mann-Whitney U over requests",
              caption_justify="left")
    t.add_column("metric", style="bold")
    for col in ("A P50", "B P50", f"A P{p}", f"B P{p}", f"Δ P{p} ms", "Δ %", "p", "verdict"):
        t.add_column(col, justify="right")
    colour = {WORSE: "red", BETTER: "green", SAME: "dim"}
    for m in c.metrics:
        d = m.diff[o.percentile]
        t.add_row(
            m.metric.upper(), f"{m.a_ms[50.0]:,.2f}", f"{m.b_ms[50.0]:,.2f}",
            f"{m.a_ms[o.percentile]:,.2f}", f"{m.b_ms[o.percentile]:,.2f}",
            f"{d.ms:+,.2f} [{d.ci_ms[0]:+,.2f}, {d.ci_ms[1]:+,.2f}]",
            f"{d.pct:+.1f} [{d.ci_pct[0]:+.1f}, {d.ci_pct[1]:+.1f}]",
            f"{m.p_value:.3g}", f"[{colour[m.verdict]}]{m.verdict}[/]",
        )
    console.print(t)
    render_slo_gates(c.goodput, [], o.confidence, console)
    for n in c.notes:
        console.print(f"[yellow]note:[/] {n}")
    failed = [m for m in c.metrics if m.gate_failed]
    if failed or not c.passed:
        worst = ", ".join([f"{m.metric.upper()} P{p} {m.diff[o.percentile].pct:+.1f}% "
                           f"(≥ {m.diff[o.percentile].ci_pct[0]:+.1f}% at {conf})"
                           for m in failed] + ([
                               f"goodput share {c.goodput.pct:+.1f}% (≤ "
                               f"{c.goodput.ci_pct[1]:+.1f}% at {conf})"]
                               if c.goodput is not None and c.goodput.gate_failed else []))
        console.print(f"[bold red]FAIL[/]: B is worse than A beyond the {o.threshold_pct:g}% "
                      f"threshold: {worst}")
    else:
        console.print(f"[bold green]PASS[/]: B is not significantly worse than A beyond "
                      f"{o.threshold_pct:g}% at P{p} ({conf} confidence)")
