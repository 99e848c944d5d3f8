"""A bench result (and optionally a timeline JSONL) read into one time axis.

Every time here is wall clock (``time.time()`` seconds), the timeline's clock: the bench stores
its requests as seconds after ``start_time`` (wall clock at the step's start), the server
stamps steps and requests with wall clock, so both views line up without guessing an offset.
The one offset left is the network and API delay between a step's end on the server and the
chunk's arrival at the client (``delay_s``), measured as the least gap between the server's
first-token time and the client's (it also absorbs a clock offset when they are two hosts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.engines import OTHER, Engine, Series, build_series, identify
from tailserve.analyze.engines import vllm as vllm_engine
from tailserve.analyze.otlp import RequestSpan, match_spans, read_spans
from tailserve.data.step import BlockedReason
from tailserve.stepcost import prefill_attention_pairs

# Admission reasons as the scheduler writes them in step records.
BLOCKED_KV = BlockedReason.KV_CACHE
BLOCKED_PREEMPTION = BlockedReason.PREEMPTION
FIRST_CHUNK_EXTRA_S = 0.005


class DiagnoseError(ValueError):
    """An input the user can fix (not a result file, a summary of several steps, ...)."""


@dataclass
class Req:
    """One request, client view and (when the server is tailserve) server view."""

    request_id: str
    ok: bool
    error_type: str | None
    prompt_len: int
    output_tokens: int
    send_t: float | None  # wall clock when the client sent it (None: unknown / vLLM file)
    ttft_s: float | None
    e2el_s: float | None
    itl_s: list[float]
    timing: dict[str, Any] | None = None  # the server's tailserve_timing
    arrival_t: float | None = None  # server wall clock
    first_token_t: float | None = None
    finished_t: float | None = None
    span: RequestSpan | None = None  # vLLM's llm_request span (diagnose --otlp-traces)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Steps:
    """Step records as arrays, sorted by ``t`` (the step's end)."""

    t: np.ndarray
    step_s: np.ndarray
    prefill: np.ndarray  # prefill tokens in the step
    decode: np.ndarray  # decode sequences in the step
    running: np.ndarray
    waiting: np.ndarray
    free_blocks: np.ndarray
    total_blocks: np.ndarray
    preemptions: np.ndarray
    blocked_by: list[str | None]
    rss: np.ndarray  # engine resident memory, bytes (NaN where not recorded)
    # The step-time model's shape columns (stepcost.py): context tokens the decodes read and
    # the prefill's causal attention pairs (older records: one prompt from its start).
    context: np.ndarray = field(default_factory=lambda: np.zeros(0))
    pairs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))  # engine's; NaN: none
    itl_target: np.ndarray = field(default_factory=lambda: np.zeros(0))  # s; NaN: none
    # After each step: the cap on a step without decodes (s) and the busy-arrival rate (/s)
    # that may lift it (engine/arrival_watch.py); NaN where not recorded.
    prefill_cap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    arrival_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    prefill_cap_by: list[str | None] = field(default_factory=list)  # what set the cap

    def __post_init__(self) -> None:
        n = len(self.prefill)
        if len(self.context) != n:
            self.context = np.zeros(n)
        if len(self.pairs) != n:
            self.pairs = np.array([prefill_attention_pairs(0, int(p)) for p in self.prefill],
                                  dtype=float)
        if len(self.predicted) != n:
            self.predicted = np.full(n, np.nan)
        if len(self.itl_target) != n:
            self.itl_target = np.full(n, np.nan)
        if len(self.prefill_cap) != n:
            self.prefill_cap = np.full(n, np.nan)
        if len(self.arrival_rate) != n:
            self.arrival_rate = np.full(n, np.nan)
        if len(self.prefill_cap_by) != n:
            self.prefill_cap_by = [None] * n

    def __len__(self) -> int:
        return len(self.t)

    @property
    def kv_usage(self) -> np.ndarray:
        return np.where(self.total_blocks > 0,
                        1.0 - self.free_blocks / np.maximum(self.total_blocks, 1), 0.0)

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Steps:
        records = sorted(records, key=lambda r: float(r["t"]))

        def col(name: str) -> np.ndarray:
            return np.array([float(r.get(name) or 0.0) for r in records], dtype=float)

        rss = np.array([float((r.get("memory") or {}).get("rss_bytes", np.nan))
                        for r in records], dtype=float)
        prefill = col("num_prefill_tokens")
        pairs = np.array([float(r["prefill_attention_pairs"]) if "prefill_attention_pairs" in r
                          else float(prefill_attention_pairs(0, int(p)))
                          for r, p in zip(records, prefill, strict=True)], dtype=float)
        def opt(name: str) -> np.ndarray:
            return np.array([np.nan if r.get(name) is None else float(r[name])
                             for r in records], dtype=float)

        return cls(t=col("t"), step_s=col("step_s"), prefill=prefill,
                   decode=col("num_decode_seqs"), running=col("num_running"),
                   waiting=col("num_waiting"), free_blocks=col("free_blocks"),
                   total_blocks=col("total_blocks"), preemptions=col("num_preemptions"),
                   blocked_by=[r.get("admission_blocked_by") for r in records], rss=rss,
                   context=col("num_decode_context_tokens"), pairs=pairs,
                   predicted=opt("predicted_s"), itl_target=opt("itl_target_s"),
                   prefill_cap=opt("prefill_step_cap_s"), arrival_rate=opt("busy_arrival_rate"),
                   prefill_cap_by=[r.get("prefill_step_cap_by") for r in records])


@dataclass
class RunData:
    requests: list[Req]
    steps: Steps | None  # None: no server timeline (another server, or not collected)
    samples: list[dict[str, Any]]  # /metrics samples: {"t", "phase", "values"}
    start_time: float | None
    duration_s: float
    source: str  # "tailserve" | "other server" | "vllm result"
    has_timing: bool  # the server's per-request timing is present
    delay_s: float = 0.0  # server step end -> client chunk arrival (the least seen)
    notes: list[str] = field(default_factory=list)
    # How the load was offered: a rate (req/s; inf: all at once) and/or a concurrency cap
    # (closed loop). Either makes "offered load" a property of the client, not of traffic.
    request_rate: float | None = None
    max_concurrency: int | None = None
    # A run through a router (bench --replica): each replica's own view (analyze/replicas.py).
    replicas: list[Any] | None = None
    # The SLOs the bench judged this run by (its result's goodput block), kind -> ms.
    slos_ms: dict[str, float] | None = None
    # Which engine served it (analyze/engines/), its version, and its /metrics samples as
    # signals with per-window deltas (None: none recorded, or tailserve's timeline serves).
    engine: Engine = field(default_factory=lambda: OTHER)
    engine_version: str | None = None
    series: Series | None = None
    # This host's GPU memory at each /metrics sample (bench/gpu.py via the observer), and why
    # there is none when NVML could not be read.
    gpu_samples: list[dict[str, Any]] = field(default_factory=list)
    gpu_why_not: str | None = None
    # The CPU time of the server's host, its process tree and the client at each sample
    # (bench/host_cpu.py; analyze/contention.py), and why there is none.
    host_cpu_samples: list[dict[str, Any]] = field(default_factory=list)
    host_cpu_why_not: str | None = None

    @property
    def has_spans(self) -> bool:
        return any(q.span is not None for q in self.requests)

    @property
    def engine_label(self) -> str:
        return self.engine.label(self.engine_version)

    @property
    def closed_loop(self) -> bool:
        rate = self.request_rate
        return self.max_concurrency is not None or (rate is not None and math.isinf(rate))


def load_run(result_path: str, timeline_path: str | None = None,
             traces_path: str | None = None) -> RunData:
    try:
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise DiagnoseError(f"cannot read the result {result_path}: {exc}") from None
    extra = read_timeline(timeline_path) if timeline_path else []
    run = run_from_result(result, extra)
    if traces_path:
        attach_spans(run, read_spans(traces_path), traces_path)
    return run


def attach_spans(run: RunData, spans: list[RequestSpan], path: str) -> None:
    """Join vLLM's request spans to the run's requests by request id (the bench sends its own
    as X-Request-Id, which vLLM's span carries), and read the run as vLLM's with them. A file
    that matches no request is the wrong file, said as such rather than silently ignored."""
    if run.has_timing:
        raise DiagnoseError(f"--otlp-traces {path}: this run has tailserve's own per-request "
                            "timing, which diagnose reads already; the traces file is for vLLM")
    if run.engine.family not in ("vllm", "other"):
        raise DiagnoseError(f"--otlp-traces {path}: the file holds vLLM's request spans, but "
                            f"the run's /metrics are {run.engine.name}'s")
    by_id = match_spans(spans, [q.request_id for q in run.requests])
    if not by_id:
        sample = ", ".join(sorted({s.request_id for s in spans})[:2])
        raise DiagnoseError(f"--otlp-traces {path}: none of its {len(spans)} llm_request spans "
                            f"(ids like {sample}) is a request of this run (ids like "
                            f"{run.requests[0].request_id if run.requests else '-'}): traces "
                            "of another run?")
    for q in run.requests:
        q.span = by_id.get(q.request_id)
    ok = [q for q in run.requests if q.ok]
    missing = sum(q.span is None for q in ok)
    if missing:
        run.notes.append(f"{missing} of {len(ok)} completed requests have no llm_request span "
                         f"in {path}: their first-token parts are fitted")
    if run.engine.family == "other":
        run.engine = vllm_engine.ENGINE
        run.series = build_series(run.engine, run.samples)
    run.engine = vllm_engine.with_spans(run.engine)


def read_timeline(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a crash can leave the last line half written
                if isinstance(rec, dict) and "t" in rec:
                    out.append(rec)
    except OSError as exc:
        raise DiagnoseError(f"cannot read the timeline {path}: {exc}") from None
    return out


def run_from_result(result: dict[str, Any],
                    extra_timeline: list[dict[str, Any]] | None = None) -> RunData:
    if not isinstance(result, dict):
        raise DiagnoseError("the result is not a JSON object")
    if "steps" in result and "tailserve" not in result:
        files = [s.get("result_file") for s in result["steps"] if isinstance(s, dict)]
        raise DiagnoseError("this is the summary of a stepped run; diagnose one step's "
                            f"result: {', '.join(str(f) for f in files)}")
    ts = result.get("tailserve")
    if not isinstance(ts, dict):
        return _from_vllm(result)
    if ts.get("replicas"):
        from tailserve.analyze.replicas import joined_run

        return joined_run(result, extra_timeline)
    start = float(ts["start_time"])
    server = ts.get("server") or {}
    records = list(server.get("timeline") or []) + list(extra_timeline or [])
    reqs = [_req(q, start) for q in ts.get("requests") or []]
    end = max([start + float(result.get("duration") or 0.0)]
              + [q.send_t + q.e2el_s for q in reqs if q.send_t is not None and q.e2el_s])
    # A shared timeline file holds other runs too: keep this run's span (and a little slack
    # for requests still finishing).
    lo, hi = start - 2.0, end + 5.0
    records = [r for r in records if lo <= float(r.get("t", 0.0)) <= hi]
    seen: set[tuple[Any, ...]] = set()
    steps, by_id = [], {}
    for r in records:
        key = (r.get("kind"), r.get("t"), r.get("request_id"))
        if key in seen:
            continue
        seen.add(key)
        if r.get("kind") == "step":
            steps.append(r)
        elif r.get("kind") == "request" and r.get("request_id"):
            by_id[str(r["request_id"])] = r
    for q in reqs:
        rec = by_id.get(q.request_id)
        if rec is None:
            continue
        q.timing = q.timing or rec.get("timing")
        q.arrival_t = rec.get("arrival_time")
        q.first_token_t = rec.get("first_token_time")
        q.finished_t = rec.get("finished_time") or rec.get("t")
    has_timing = any(q.timing for q in reqs)
    run = RunData(requests=reqs, steps=Steps.from_records(steps) if steps else None,
                  samples=list(server.get("metric_samples") or []), start_time=start,
                  duration_s=end - start, source="tailserve" if has_timing else "other server",
                  has_timing=has_timing, request_rate=_rate(result.get("request_rate")),
                  max_concurrency=result.get("max_concurrency"),
                  slos_ms=_bench_slos(ts.get("goodput")))
    _fill_server_times(run)
    _identify(run, server, ts.get("environment") or result.get("environment"))
    run.gpu_samples = [x for x in server.get("gpu_samples") or [] if isinstance(x, dict)]
    run.gpu_why_not = server.get("gpu_why_not")
    run.host_cpu_samples = [x for x in server.get("host_cpu_samples") or []
                            if isinstance(x, dict)]
    run.host_cpu_why_not = server.get("host_cpu_why_not")
    return run


def _identify(run: RunData, server: dict[str, Any], env: Any) -> None:
    """The engine from the /metrics names the bench saw (else /v1/models' owned_by), and
    its signals when diagnose has no timeline of its own to read."""
    srv = (env or {}).get("server") if isinstance(env, dict) else None
    srv = srv if isinstance(srv, dict) else {}
    names = list(server.get("metric_names") or [])
    for x in run.samples[:3]:
        names += list((x.get("values") or {}) if isinstance(x, dict) else [])
    run.engine = identify(names, srv.get("owned_by") or [])
    if run.has_timing and run.engine.family != "tailserve":
        run.engine = identify(["tailserve:"])
    run.engine_version = str(srv["version"]) if srv.get("version") else None
    if not run.has_timing and run.engine.family != "tailserve":
        run.series = build_series(run.engine, run.samples)


def _bench_slos(good: Any) -> dict[str, float] | None:
    """The SLOs of a bench result's goodput block (kind -> ms); None without one."""
    if not isinstance(good, dict):
        return None
    slos = {k: float(good[f"{k}_ms"]) for k in ("ttft", "itl", "tpot", "e2el")
            if isinstance(good.get(f"{k}_ms"), (int, float))}
    return slos or None


def _rate(value: Any) -> float | None:
    """The bench writes an infinite rate as "inf" (JSON has no infinity)."""
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _req(q: dict[str, Any], start: float) -> Req:
    send = q.get("send_s")
    timing = q.get("server_timing")
    return Req(request_id=str(q.get("request_id")), ok=q.get("error_type") is None,
               error_type=q.get("error_type"), prompt_len=int(
                   (timing or {}).get("prompt_tokens") or q.get("server_prompt_tokens")
                   or q.get("prompt_len") or 0),
               output_tokens=int(q.get("output_tokens") or 0),
               send_t=None if send is None else start + float(send),
               ttft_s=q.get("ttft_s"), e2el_s=q.get("e2el_s"),
               itl_s=[float(x) for x in q.get("itl_s") or []], timing=timing)


def _fill_server_times(run: RunData) -> None:
    """Server wall times the timeline did not give, from the timing dict and the client's
    send time; and the step-end -> chunk delay."""
    delays = [q.send_t + q.ttft_s - q.first_token_t for q in run.requests
              if q.send_t is not None and q.ttft_s is not None and q.first_token_t is not None]
    # The smallest, less FIRST_CHUNK_EXTRA_S, floored at 0: a chunk never reaches the client
    # before its step ended, so the shift must stay below every chunk's delay or a quick chunk
    # lands before its own step (a median shift does that under load). A first token's path
    # is a little longer than a later chunk's; on one host the shift is then simply 0, and
    # across hosts it absorbs most of a clock offset.
    run.delay_s = max(0.0, float(np.min(delays)) - FIRST_CHUNK_EXTRA_S) if delays else 0.0
    for q in run.requests:
        if q.timing is None or q.send_t is None:
            continue
        if q.arrival_t is None:
            q.arrival_t = q.send_t  # the request leaves the client and lands within ~1 ms
        ttft, e2e = q.timing.get("ttft_s"), q.timing.get("e2e_s")
        if q.first_token_t is None and ttft is not None:
            q.first_token_t = q.arrival_t + float(ttft)
        if q.finished_t is None and e2e is not None:
            q.finished_t = q.arrival_t + float(e2e)


def _from_vllm(result: dict[str, Any]) -> RunData:
    """vLLM's own ``--save-detailed`` file: per-request lists, no send times."""
    ttfts = result.get("ttfts")
    if not isinstance(ttfts, list):
        raise DiagnoseError("the result has neither a tailserve block nor vLLM's per-request "
                            "lists (save it with --save-detailed)")
    n = len(ttfts)

    def get(name: str, default: Any) -> list[Any]:
        v = result.get(name)
        return v if isinstance(v, list) and len(v) == n else [default] * n

    ins, outs, itls, errs = get("input_lens", 0), get("output_lens", 0), get("itls", []), \
        get("errors", "")
    reqs = []
    for i in range(n):
        ok = not errs[i] and ttfts[i] > 0
        e2el = (ttfts[i] + sum(itls[i])) if ok else None
        reqs.append(Req(request_id=str(i), ok=ok, error_type=None if ok else "error",
                        prompt_len=int(ins[i] or 0), output_tokens=int(outs[i] or 0),
                        send_t=None, ttft_s=ttfts[i] if ok else None, e2el_s=e2el,
                        itl_s=list(itls[i] or [])))
    return RunData(requests=reqs, steps=None, samples=[], start_time=None,
                   duration_s=float(result.get("duration") or 0.0), source="vllm result",
                   has_timing=False,
                   notes=["vLLM's result has no send times: no time windows"])
