"""The server's side of the same time window: /metrics samples and /debug/timeline records.

``/metrics`` is sampled before the step, once per ``interval_s`` during it and after it; the
timeline is polled every ``TIMELINE_POLL_S`` (so the server's ring buffer cannot drop records
of a long run) and once at the end. Both use wall-clock ``t`` (``time.time()``), the
timeline's clock, so samples, timeline records and the client's requests (whose step start is
stored as wall clock too) line up.

The observer runs in its own process: fetching and decoding a few megabytes of timeline JSON
takes milliseconds of CPU, and in the client's event loop (or a thread holding the GIL) that
would delay chunk reads and inflate the very latencies being measured. Results come back as
JSON over a pipe when the step ends.

With the "before", every "during" and the "after" sample the observer also reads this host's
GPU memory through NVML when it can (bench/gpu.py: ``gpu_samples``, and ``gpu_why_not`` when
it cannot), so the seeds' memory watermark shares the time window; and, when the server is on
this host, the CPU time the host gave to other work (bench/host_cpu.py: ``host_cpu_samples``,
else ``host_cpu_why_not``), for diagnose's ``cpu_contention``.

Against a server without these routes the parts are simply absent; other engines' gauges,
counters and histogram sums and counts are sampled too when present (``vllm:``, ``sglang:``,
``llamacpp:``): analyze/engines/ reads them as per-window deltas. llama-server's ``/slots``
(each slot's context size, whether it is busy, the tokens it holds) goes with each of its
samples as ``slots``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from tailserve.bench.gpu import GpuWatermark
from tailserve.bench.host_cpu import HostCpu

GAUGES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "kv_cache_free_blocks", "kv_cache_total_blocks", "num_preemptions_total",
    "device_memory_used_bytes", "torch_memory_allocated_bytes", "torch_memory_reserved_bytes",
    "prompt_tokens_total", "generation_tokens_total", "requests_rejected_total",
    "gpu_cache_usage_perc",  # older vLLM's name for kv_cache_usage_perc
    # The server's SLOs and their attainment (bench/goodput.py reads the SLO gauges once in
    # the pre-flight; the counters are labelled per SLO kind and priority).
    "slo_ttft_seconds", "slo_itl_seconds", "min_decode_slack_seconds", "slo_attained_total",
    "slo_missed_total",
})
# Histograms whose _sum and _count other engines' adapters read as per-window deltas (the
# buckets are left out: a few hundred lines a sample).
_HIST = ("request_queue_time_seconds", "request_prefill_time_seconds",
         "request_decode_time_seconds", "time_to_first_token_seconds",
         "inter_token_latency_seconds", "e2e_request_latency_seconds", "queue_time_seconds")
_SUMS = frozenset(f"{h}_{s}" for h in _HIST for s in ("sum", "count"))
KEPT: dict[str, frozenset[str]] = {
    "tailserve:": GAUGES,
    "vllm:": GAUGES | _SUMS,
    "sglang:": frozenset({"num_running_reqs", "num_queue_reqs", "token_usage",
                          "num_used_tokens", "prompt_tokens_total", "generation_tokens_total",
                          "cache_hit_rate"}) | _SUMS,
    "llamacpp:": frozenset({"requests_processing", "requests_deferred", "prompt_tokens_total",
                            "prompt_seconds_total", "tokens_predicted_total",
                            "tokens_predicted_seconds_total", "n_decode_total",
                            "n_busy_slots_per_decode", "n_tokens_max"}),
}
PREFIXES = tuple(KEPT)
UNPREFIXED = frozenset({"process_resident_memory_bytes"})
TIMELINE_POLL_S = 10.0
# Records can be appended slightly out of time order (step and request records are stamped in
# different processes); each poll re-reads this much of the past and drops duplicates.
TIMELINE_OVERLAP_S = 2.0


def parse_metrics(text: str) -> dict[str, float]:
    """The samples we keep, keyed by name with labels (``tailserve:x{device="cpu"}``).

    A line filter, not a full parser: it runs once a second and most of a /metrics page
    (histogram buckets) is not wanted.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        labelled = brace >= 0 and (space < 0 or brace < space)
        name_end = brace if labelled else space
        if name_end <= 0:
            continue
        name = line[:name_end]
        if name not in UNPREFIXED and not any(
            name.startswith(p) and name[len(p):] in kept for p, kept in KEPT.items()
        ):
            continue
        key_end = line.rfind("}") + 1 if labelled else name_end
        fields = line[key_end:].split()
        if not fields:
            continue
        try:
            out[line[:key_end]] = float(fields[0])
        except ValueError:
            continue
    return out


def available_gauges(text: str) -> list[str]:
    return sorted(parse_metrics(text))


def slot_numbers(slot: dict[str, Any]) -> dict[str, Any]:
    """One /slots entry of llama-server, kept to what diagnose reads: the tokens a slot
    holds are its prompt's plus those decoded so far."""
    nxt = slot.get("next_token")
    decoded = nxt[0].get("n_decoded") if isinstance(nxt, list) and nxt and \
        isinstance(nxt[0], dict) else None
    return {"id": slot.get("id"), "n_ctx": slot.get("n_ctx"),
            "is_processing": bool(slot.get("is_processing")),
            "n_prompt_tokens": slot.get("n_prompt_tokens"), "n_decoded": decoded}


def timeline_key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record.get("kind"), record.get("t"), record.get("request_id"))


class ObserverProcess:
    """Start before the step (returns once the "before" sample is taken), ``stop()`` after.

    One server (``base_url``), or with ``replicas`` several more watched by the same process
    (bench/replicas.py): ``stop()`` then also returns ``"replicas"``, one observation per URL
    in the order given, each with its ``/health`` at every sample as well.
    """

    def __init__(self, base_url: str | None, headers: dict[str, str], metrics: bool,
                 timeline: bool, interval_s: float = 1.0,
                 replicas: list[tuple[str, bool, bool]] | None = None,
                 gpu: bool = True) -> None:
        targets = [] if base_url is None else [(base_url, metrics, timeline, False)]
        targets += [(url, m, t, True) for url, m, t in replicas or []]
        # The GPU watermark is this host's: it goes with the main server's observation.
        self.args = (targets, headers, interval_s, gpu and base_url is not None)
        self.has_main = base_url is not None
        self._conn: Connection | None = None
        self._proc: Any = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with an event loop
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_observer_main, args=(child, *self.args), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        # Wait for the "before" sample, so it really is before the first request.
        if not parent.poll(60) or parent.recv_bytes() != b"ready":
            self._kill()
            raise RuntimeError("the metrics observer process did not start")

    def stop(self) -> dict[str, Any]:
        """The samples and timeline records; empty lists if the observer failed."""
        assert self._conn is not None and self._proc is not None
        outs: list[dict[str, Any]] | None = None
        try:
            self._conn.send_bytes(b"stop")
            if self._conn.poll(120):
                outs = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            pass
        finally:
            self._proc.join(10)
            self._kill()
        n = len(self.args[0])
        if outs is None:
            outs = [{"metric_samples": [], "timeline": [], "errors": ["observer process died"]}
                    for _ in range(n)]
        out = outs[0] if self.has_main else {}
        if n > int(self.has_main):
            out = {**out, "replicas": outs[int(self.has_main):]}
        return out

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


class _Target:
    """One server's samples and timeline records, as the observer process collects them."""

    def __init__(self, base_url: str, headers: dict[str, str], metrics: bool, timeline: bool,
                 health: bool, start: float) -> None:
        from tailserve.bench.preflight import SyncHTTP

        self.http = SyncHTTP(base_url, headers, timeout_s=10.0)
        self.metrics, self.timeline, self.health = metrics, timeline, health
        self.samples: list[dict[str, Any]] = []
        self.health_samples: list[dict[str, Any]] = []
        self.records: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.errors: list[str] = []
        self.start = start
        self.since = start - TIMELINE_OVERLAP_S
        self.slots: bool | None = None  # None: not known yet whether /slots is there

    def sample(self, phase: str) -> None:
        from tailserve.bench import BenchError

        if self.health:
            t = time.time()
            try:
                status, _ = self.http.request("GET", "/health")
                self.health_samples.append({"t": t, "phase": phase, "status": status})
            except BenchError as exc:
                self.health_samples.append({"t": t, "phase": phase, "error": str(exc)})
        if not self.metrics:
            return
        t = time.time()
        try:
            status, raw = self.http.request("GET", "/metrics")
        except BenchError as exc:
            self.samples.append({"t": t, "phase": phase, "error": str(exc)})
            return
        if status != 200:
            self.samples.append({"t": t, "phase": phase, "error": f"HTTP {status}"})
            return
        values = parse_metrics(raw.decode())
        sample: dict[str, Any] = {"t": t, "phase": phase, "values": values}
        if self.slots is None:  # first sample: is it llama-server, whose /slots says more?
            self.slots = any(k.startswith("llamacpp:") for k in values)
        if self.slots:
            sample["slots"] = self._slots()
        self.samples.append(sample)

    def _slots(self) -> list[dict[str, Any]] | None:
        """llama-server's /slots, the numbers only (each slot's context size, whether it is
        busy and the tokens it holds; not the prompt and text it also returns)."""
        from tailserve.bench import BenchError

        try:
            status, body = self.http.get_json("/slots")
        except BenchError as exc:
            self.errors.append(f"/slots: {exc}")
            self.slots = False
            return None
        if status != 200 or not isinstance(body, list):
            self.errors.append(f"/slots: HTTP {status} (llama-server --no-slots?)")
            self.slots = False
            return None
        return [slot_numbers(x) for x in body if isinstance(x, dict)]

    def poll_timeline(self) -> None:
        from tailserve.bench import BenchError

        if not self.timeline:
            return
        try:
            status, body = self.http.get_json(f"/debug/timeline?since={self.since}")
        except BenchError as exc:
            self.errors.append(f"timeline: {exc}")
            return
        if status != 200 or not isinstance(body, dict):
            self.errors.append(f"timeline: HTTP {status}")
            return
        got = body.get("records") or []
        for r in got:
            if isinstance(r, dict):
                self.records[timeline_key(r)] = r
        if got:
            self.since = max(self.since, float(got[-1].get("t", self.since)) - TIMELINE_OVERLAP_S)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metric_samples": self.samples, "errors": self.errors}
        if self.health:
            out["health"] = self.health_samples
        if self.timeline:
            ordered = sorted(self.records.values(), key=lambda r: float(r.get("t", 0.0)))
            out["timeline"] = [r for r in ordered if float(r.get("t", 0.0)) >= self.start - 1.0]
        self.http.close()
        return out


class _Gpu:
    """This host's GPU memory at each sample (bench/gpu.py), for the main server's result."""

    def __init__(self, gpu: bool | GpuWatermark) -> None:
        self.reader = (GpuWatermark() if gpu is True else gpu) or None
        self.samples: list[dict[str, Any]] = []

    @property
    def active(self) -> bool:
        return self.reader is not None

    def sample(self, phase: str) -> None:
        devices = self.reader.read() if self.reader is not None else None
        if devices:
            self.samples.append({"t": time.time(), "phase": phase,
                                 "devices": [d.as_json() for d in devices]})

    def result(self) -> dict[str, Any]:
        if self.reader is None:
            return {}
        out: dict[str, Any] = {"gpu_samples": self.samples}
        if self.reader.why_not:
            out["gpu_why_not"] = self.reader.why_not
        return out


def _observer_main(conn: Connection, targets: list[tuple[str, bool, bool, bool]],
                   headers: dict[str, str], interval_s: float,
                   gpu: bool | GpuWatermark = False) -> None:
    """``gpu``: read NVML (True), or this reader (tests pass one over a fake NVML)."""
    start = time.time()
    watched = [_Target(url, headers, m, t, h, start) for url, m, t, h in targets]
    g = _Gpu(gpu)
    # This host's readings go with the main server's observation: its GPU memory and, when the
    # server runs here, its CPU (bench/host_cpu.py; the observer's parent is the bench
    # process: the client, whose CPU is not "other work").
    hosts: list[_Gpu | HostCpu] = [g]
    if targets and not targets[0][3]:
        hosts.append(HostCpu(targets[0][0], os.getppid()))
    sampled = any(w.metrics or w.health for w in watched) or any(h.active for h in hosts)
    for w in watched:
        w.sample("before")
    for h in hosts:
        h.sample("before")
    conn.send_bytes(b"ready")
    next_sample = time.monotonic() + interval_s
    next_poll = time.monotonic() + TIMELINE_POLL_S
    while True:
        wait = max(0.0, min(next_sample, next_poll) - time.monotonic())
        if conn.poll(wait):
            conn.recv_bytes()
            break
        now = time.monotonic()
        if sampled and now >= next_sample:
            for w in watched:
                w.sample("during")
            for h in hosts:
                h.sample("during")
            next_sample += interval_s
            if next_sample < now:  # a slow scrape: skip the missed ticks, don't burst
                next_sample = now + interval_s
        if now >= next_poll:
            for w in watched:
                w.poll_timeline()
            next_poll = now + TIMELINE_POLL_S
    for w in watched:
        w.sample("after")
        w.poll_timeline()
    for h in hosts:
        h.sample("after")
    results = [w.result() for w in watched]
    for h in hosts:
        if results:
            results[0] |= h.result()  # ObserverProcess puts the main server first
    conn.send_bytes(json.dumps(results).encode())
