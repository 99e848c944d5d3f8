"""What the terminal shows: the live progress bar, a step's tables, the sweep summary, and
the latency-vs-rate plot (in the terminal, and as a self-contained SVG beside the result)."""

from __future__ import annotations

import asyncio
import math
from time import perf_counter
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.table import Table

from tailserve.bench.metrics import p_word


class Progress:
    """completed / in flight / failed, drawn off the request path.

    ``sent``/``finished`` only bump counters. A redraw (rich renders the line: ~2 ms of CPU
    on a 2-core VM) never runs in rich's own refresh thread: that thread would hold the GIL
    while a response arrives, and at 4 redraws/s about 1% of requests would pay up to 2-5
    ms of TTFT (benchmarks/notes/tools.md). Instead the open loop calls ``idle()`` after each
    response, which redraws when nothing is in flight and the next send is far enough away,
    and ``watch()`` (a task) redraws a display that has gone ``STALE_S`` without one (rate
    inf, or requests always in flight); a frequent timer of its own would land on sends and
    responses at random.
    """

    INTERVAL_S = 0.25  # at most 4 redraws a second
    STALE_S = 1.0
    IDLE_GAP_S = 0.01  # a redraw fits well before a send this far away

    def __init__(self, console: Console, total: int, name: str, enabled: bool) -> None:
        self.console, self.total, self.name, self.enabled = console, total, name, enabled
        self.inflight = self.done = self.failed = 0
        self._bar: Any = None
        self._task: Any = None
        self._drawn = 0.0

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich import progress as rp

            self._bar = rp.Progress(
                rp.TextColumn(f"[bold]{self.name}[/]"), rp.BarColumn(),
                rp.MofNCompleteColumn(),
                rp.TextColumn("in flight {task.fields[inflight]}"),
                rp.TextColumn("[red]failed {task.fields[failed]}[/]"),
                rp.TimeElapsedColumn(), console=self.console, auto_refresh=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total, inflight=0, failed=0)
            self._draw()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._draw()
            self._bar.stop()

    def sent(self) -> None:
        self.inflight += 1

    def finished(self, ok: bool) -> None:
        self.inflight -= 1
        self.done += 1
        self.failed += not ok

    def idle(self, gap_s: float) -> None:
        """The open loop has ``gap_s`` until its next send: redraw if nothing is in flight,
        the gap is long enough and a redraw is due."""
        if (self._bar is not None and self.inflight == 0 and gap_s >= self.IDLE_GAP_S
                and perf_counter() - self._drawn >= self.INTERVAL_S):
            self._draw()

    async def watch(self) -> None:
        """Runs beside the open loop: redraws a display that ``idle()`` left stale."""
        if self._bar is None:
            return
        while True:
            await asyncio.sleep(self.STALE_S / 4)
            if perf_counter() - self._drawn >= self.STALE_S:
                self._draw()

    def _draw(self) -> None:
        self._bar.update(self._task, completed=self.done, inflight=self.inflight,
                         failed=self.failed)
        self._bar.refresh()
        self._drawn = perf_counter()


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def print_step(console: Console, r: dict[str, Any], percentiles: list[float]) -> None:
    ts = r["tailserve"]
    t = Table(title=f"step {ts['step']['index']}: {ts['step']['name']}", show_header=False,
              title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
        ("Request rate configured (req/s)", r["request_rate"]),
        ("Burstiness", r["burstiness"]), ("Max concurrency configured", r["max_concurrency"]),
        ("Max concurrency reached", r["max_concurrent_requests"]),
        ("Duration (s)", r["duration"]), ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", r["request_throughput"]),
        ("Request goodput (req/s)", r["request_goodput"]),
        ("Output token throughput (tok/s)", r["output_throughput"]),
        ("Total token throughput (tok/s)", r["total_token_throughput"]),
        ("Send lag P99 / max (ms)",
         f"{ts['send_lag_ms'].get('p99', 0.0):.2f} / {ts['send_lag_ms']['max']:.2f}"),
    ]
    for name, value in rows:
        t.add_row(name, _fmt(value))
    console.print(t)

    lat = Table(title="latency (ms)", title_justify="left")
    cols = ["mean", "median", "std", *(f"p{p_word(p)}" for p in percentiles)]
    lat.add_column("")
    for c in cols:
        lat.add_column(c.upper() if c[0] == "p" else c, justify="right")
    for m in ("ttft", "tpot", "itl", "e2el"):
        lat.add_row(m.upper(), *(_fmt(r[f"{c}_{m}_ms"]) for c in cols))
    console.print(lat)

    lengths = ts["lengths"]
    tail = _tail_key(percentiles)
    inp, out = lengths["input"], lengths["output_requested"]
    console.print(
        f"lengths sent (tokens): input mean {inp['mean']:.0f}, median {inp['median']:.0f}, "
        f"{tail.upper()} {inp.get(tail, 0.0):.0f}, range {lengths['input_min']}–"
        f"{lengths['input_max']}; output asked mean {out['mean']:.0f}, received mean "
        f"{lengths['output_received']['mean']:.0f}")
    good = ts.get("goodput")
    if good is not None:
        console.print(goodput_line(good))
    if ts.get("answers"):
        for line in answer_lines(ts["answers"]):
            console.print(line)
    failures = ts["failures"]
    if r["failed"]:
        f = Table(title="failures", title_justify="left")
        f.add_column("type")
        f.add_column("count", justify="right")
        f.add_column("example")
        for typ, n in sorted(failures["by_type"].items(), key=lambda kv: -kv[1]):
            f.add_row(typ, str(n), failures["examples"].get(typ, "")[:100])
        console.print(f)
        console.print("by HTTP status: " + ", ".join(
            f"{k}: {v}" for k, v in sorted(failures["by_status"].items())))
    server = ts.get("server")
    if server:
        console.print(_server_line(server))
    for w in ts["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")


def answer_lines(answers: dict[str, Any]) -> list[str]:
    """One line per form of structured request: valid share, cuts, latency; then grammar."""
    lines = []
    lat = answers["latency_ms"]
    for form, row in answers["by_form"].items():
        calls = (f", {row['calls_valid']}/{row['calls']} calls valid, "
                 f"{row['called_share']:.0%} of requests called"
                 if "calls" in row else "")
        ms = lat.get(form, {})
        lines.append(
            f"answers {form}: {row['valid']}/{row['requests']} valid "
            f"({row['valid_share']:.1%}; {row['cut_by_max_tokens']} cut by max_tokens){calls}; "
            f"TTFT P50/P99 {ms.get('p50_ttft_ms', 0.0):.1f}/{ms.get('p99_ttft_ms', 0.0):.1f} ms, "
            f"ITL P50 {ms.get('p50_itl_ms', 0.0):.1f} ms")
        if form in answers["examples"]:
            lines.append(f"  e.g. {answers['examples'][form][:160]}")
    if "unconstrained" in lat:
        ms = lat["unconstrained"]
        lines.append(f"unconstrained: TTFT P50/P99 {ms['p50_ttft_ms']:.1f}/"
                     f"{ms['p99_ttft_ms']:.1f} ms, ITL P50 {ms['p50_itl_ms']:.1f} ms")
    g = answers.get("grammar")
    if g:
        share = g["share_of_e2e"]
        of = f", {share:.1%} of their end-to-end time" if share is not None else ""
        lines.append(f"grammar (server): P50/P99/max {g['grammar_ms']['p50']:.1f}/"
                     f"{g['grammar_ms']['p99']:.1f}/{g['grammar_ms']['max']:.1f} ms "
                     f"a request{of}")
    return lines


def goodput_line(good: dict[str, Any]) -> str:
    """One step's goodput (result.py's ``goodput`` block) in words."""
    names = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2el": "E2EL"}
    slos = ", ".join(f"{names[k]} <= {good[f'{k}_ms']:g} ms" for k in names
                     if good.get(f"{k}_ms") is not None)
    share = good["goodput_share"]
    missed = ", ".join(f"{names[k]} {n}" for k, n in good["missed"].items())
    failed = f", failed {good['num_failed']}" if good["num_failed"] else ""
    return (f"goodput ({slos}; {good['source']}'s SLOs): "
            f"{good['num_good']}/{good['num_sent']} requests"
            + ("" if share is None else f" = {100 * share:.1f}%")
            + ("" if good["request_goodput"] is None else
               f", {good['request_goodput']:.3g} req/s")
            + f"; missed {missed}{failed}")


def _server_line(server: dict[str, Any]) -> str:
    """Peaks of the server's gauges over the step, from the /metrics samples."""
    peaks: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s in server.get("metric_samples", []):
        for k, v in (s.get("values") or {}).items():
            name = k.split(":", 1)[-1]
            peaks[name] = max(peaks.get(name, v), v)
            first.setdefault(name, v)
            last[name] = v
    parts = []
    for name, label in (("num_requests_running", "running"),
                        ("num_requests_waiting", "waiting")):
        if name in peaks:
            parts.append(f"peak {label} {peaks[name]:g}")
    for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
        if name in peaks:
            parts.append(f"peak KV usage {100 * peaks[name]:.1f}%")
    if "num_preemptions_total" in last:
        delta = last["num_preemptions_total"] - first["num_preemptions_total"]
        parts.append(f"preemptions {delta:g}")
    if "process_resident_memory_bytes" in peaks:
        parts.append(f"peak API RSS {peaks['process_resident_memory_bytes'] / 2**20:.0f} MiB")
    timeline = server.get("timeline")
    if timeline is not None:
        kinds = [rec.get("kind") for rec in timeline]
        parts.append(f"timeline {kinds.count('step')} steps, {kinds.count('request')} requests")
    n = len(server.get("metric_samples", []))
    return f"server: {n} /metrics samples; " + ", ".join(parts)


def _tail_key(percentiles: list[float]) -> str:
    return "p99" if 99.0 in percentiles else f"p{p_word(max(percentiles))}"


def print_sweep(console: Console, steps: list[dict[str, Any]], percentiles: list[float]) -> None:
    tail = _tail_key(percentiles)
    t = Table(title="summary", title_justify="left")
    for c in ("step", "rate", "req/s", "out tok/s", "TTFT P50", f"TTFT {tail.upper()}",
              f"ITL {tail.upper()}", f"TPOT {tail.upper()}", f"E2EL {tail.upper()}", "failed",
              "goodput", "good %"):
        t.add_column(c, justify="left" if c == "step" else "right")
    for s in steps:
        share = (s["tailserve"].get("goodput") or {}).get("goodput_share")
        t.add_row(s["tailserve"]["step"]["name"], _fmt(s["request_rate"]),
                  _fmt(s["request_throughput"]), _fmt(s["output_throughput"], 1),
                  _fmt(s["median_ttft_ms"], 1), _fmt(s[f"{tail}_ttft_ms"], 1),
                  _fmt(s[f"{tail}_itl_ms"], 1),
                  _fmt(s[f"{tail}_tpot_ms"], 1), _fmt(s[f"{tail}_e2el_ms"], 1),
                  str(s["failed"]), _fmt(s["request_goodput"]),
                  "-" if share is None else f"{100 * share:.1f}")
    console.print(t)
    xs, series = plot_series(steps, tail)
    console.print(ascii_plot(xs, series), highlight=False, markup=False)


def print_capacity(console: Console, capacity: dict[str, Any], slos: Any) -> None:
    """The sweep's answer: for each target share, the highest rate measured to meet it."""
    for c in capacity["targets"]:
        head = f"capacity at >= {100 * c['target']:g}% meeting {slos.describe()}: "
        rate, miss = c["capacity_req_s"], c["lowest_missing_rate"]
        if rate is None:
            console.print(head + "[red]no rate measured met it[/]" + (
                f" (lowest tried {miss:.3g} req/s)" if miss is not None else ""))
            continue
        bound = (f"; {miss:.3g} req/s missed it" if miss is not None
                 else "; no rate tried missed it (a lower bound)")
        loose = "" if c["resolved"] else " [yellow](not resolved within the steps allowed)[/]"
        console.print(f"{head}[bold]{rate:.3g} req/s[/]{bound}{loose}")


def plot_series(steps: list[dict[str, Any]],
                tail: str = "p99") -> tuple[list[float], dict[str, list[float]]]:
    """x: achieved request throughput; y: TTFT P50 / tail and E2EL tail (ms), by x."""
    order = sorted(steps, key=lambda s: s["request_throughput"])
    xs = [float(s["request_throughput"]) for s in order]
    keys = {"TTFT P50": "median_ttft_ms", f"TTFT {tail.upper()}": f"{tail}_ttft_ms",
            f"E2EL {tail.upper()}": f"{tail}_e2el_ms"}
    return xs, {name: [float(s[k]) for s in order] for name, k in keys.items()}


def _log_scale(series: dict[str, list[float]]) -> tuple[float, float]:
    ys = [y for v in series.values() for y in v if y > 0]
    lo, hi = (min(ys), max(ys)) if ys else (1.0, 10.0)
    return math.log10(lo), math.log10(hi) if hi > lo else math.log10(lo) + 1


def ascii_plot(xs: list[float], series: dict[str, list[float]], width: int = 60,
               height: int = 14) -> str:
    """Latency (log scale) against achieved req/s, one marker per series."""
    lo, hi = _log_scale(series)
    x0, x1 = min(xs), max(xs)
    grid = [[" "] * width for _ in range(height)]
    marks = "ox*+"
    for mark, ys in zip(marks, series.values(), strict=False):
        for x, y in zip(xs, ys, strict=True):
            if y <= 0:
                continue
            col = round((x - x0) / ((x1 - x0) or 1.0) * (width - 1))
            row = height - 1 - round((math.log10(y) - lo) / (hi - lo) * (height - 1))
            grid[max(0, min(height - 1, row))][col] = mark
    label_w = 9
    lines = ["latency (ms, log) vs achieved request rate (req/s)"]
    for i, cells in enumerate(grid):
        v = 10 ** (hi - (hi - lo) * i / (height - 1))
        label = f"{v:>{label_w}.4g}" if i in (0, height // 2, height - 1) else " " * label_w
        lines.append(f"{label} |{''.join(cells)}")
    lines.append(" " * label_w + " +" + "-" * width)
    lines.append(" " * (label_w + 2) + f"{x0:<{width // 2}.4g}{x1:>{width - width // 2}.4g}")
    lines.append("   " + "   ".join(f"{m} {name}" for m, name in zip(marks, series, strict=False)))
    return "\n".join(lines)


def write_svg_plot(path: str, steps: list[dict[str, Any]], tail: str = "p99") -> None:
    """A self-contained SVG of ``plot_series`` (no plotting library needed)."""
    xs, series = plot_series(steps, tail)
    w, h, ml, mr, mt, mb = 720, 420, 70, 20, 30, 50
    lo, hi = _log_scale(series)
    x0, x1 = min(xs), max(xs)

    def px(x: float) -> float:
        return ml + (x - x0) / ((x1 - x0) or 1.0) * (w - ml - mr)

    def py(y: float) -> float:
        return h - mb - (math.log10(max(y, 1e-9)) - lo) / (hi - lo) * (h - mt - mb)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{ml}" y="18">latency (ms, log scale) vs achieved request rate</text>',
           f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>']
    for i in range(5):
        x = x0 + (x1 - x0) * i / 4
        y = 10 ** (lo + (hi - lo) * i / 4)
        out.append(f'<text x="{px(x):.1f}" y="{h - mb + 16}" text-anchor="middle">{x:.3g}</text>')
        out.append(f'<text x="{ml - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    out.append(f'<text x="{(w + ml) / 2}" y="{h - 12}" text-anchor="middle">req/s</text>')
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
    for k, (name, ys) in enumerate(series.items()):
        c = colors[k % len(colors)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{pts}"/>')
        for x, y in zip(xs, ys, strict=True):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        out.append(f'<text x="{w - mr - 130}" y="{mt + 16 * (k + 1)}" fill="{c}">{name}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
