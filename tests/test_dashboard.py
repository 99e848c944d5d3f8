"""GET /dashboard: the feed (unit), the key, the SSE stream, and the page in a real browser;
and POST /debug/profile on the same live server (one server start for both).

The browser is Debian's chromium driven by Playwright for Python (``make setup-browser``
installs it; ``playwright install`` is never needed). Without a chromium that launches, the
browser test skips with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_util import ServerProcess
from tailserve.data.records import EngineState, RequestRecord
from tailserve.data.step import StepStats
from tailserve.obs.metrics import ServerMetrics
from tailserve.server.dashboard import page_html
from tailserve.server.dashboard.feed import DashboardFeed, percentile

KEY = "dash-key"


# ---------------------------------------------------------------- the feed, no server


def _step(t: float, step_s: float, preemptions: int = 0) -> StepStats:
    return StepStats(t, step_s, 0, 1, 1, 1, 0, 90, 100, preemptions, 0, 0, 0)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([1.0, 2.0], 50) == 1.0


def test_sample_joins_state_steps_requests_and_counters() -> None:
    metrics = ServerMetrics()
    state = EngineState(100.0, 3, 2, 90, 100, 0, memory={"rss_bytes": 5.0, "kv_cache_bytes": 7.0},
                        kv_band_used=[4, 6, 0, 0])
    feed = DashboardFeed(metrics, lambda: state)
    for i in range(10):
        feed.on_step(_step(99.5 + i * 0.01, 0.001 * (i + 1), preemptions=1 if i == 3 else 0))
    feed.on_step(_step(90.0, 5.0))  # older than the last second: not in this sample's steps
    ttfts = [0.1, 0.2, 0.3, 0.4]
    for i, ttft in enumerate(ttfts):
        feed.on_request(RequestRecord(95.0 + i, f"r{i}", "stop", 4, 3, timing={"ttft_s": ttft},
                                      itl_s=[0.01, 0.03]))
    feed.on_request(RequestRecord(10.0, "old", "stop", 4, 3, timing={"ttft_s": 9.0}))
    metrics.request_errors.labels(type="engine_error").inc(2)
    metrics.on_rejected("queue_full")
    for i in range(3):
        metrics.on_request_finished(RequestRecord(99.0, f"a{i}", "abort", 4, 1,
                                                  abort_reason="client_disconnect"))

    s = feed.sample(now=100.0)
    assert (s["running"], s["waiting"], s["total_blocks"]) == (3, 2, 100)
    assert s["kv_usage"] == pytest.approx(0.1)
    assert s["kv_bands"] == [4 / 25, 6 / 25, 0.0, 0.0]  # 100 blocks in 4 bands of 25
    assert s["memory"] == {"engine_rss": 5.0, "kv_cache": 7.0}
    assert s["steps"] == 10 and s["step_p50"] == pytest.approx(0.005)
    assert s["step_max"] == pytest.approx(0.010)
    assert s["ttft_n"] == 4 and s["ttft_p50"] == 0.2 and s["ttft_p99"] == 0.4  # "old" dropped
    assert s["itl_n"] == 8 and s["itl_p50"] == 0.01 and s["itl_p99"] == 0.03
    assert s["preemptions_total"] == 1
    assert s["errors"] == {"engine_error": 2.0} and s["rejected"] == {"queue_full": 1.0}
    assert s["aborts"] == {"client_disconnect": 3.0}  # an abort storm shows as such
    json.dumps(s)  # what the stream sends


def test_one_sampler_serves_every_viewer() -> None:
    state = EngineState(1.0, 1, 0, 10, 10, 0)
    feed = DashboardFeed(ServerMetrics(), lambda: state, interval_s=0.02)

    async def viewer(n: int) -> list[str]:
        got = []
        async with contextlib.aclosing(feed.events()) as events:
            async for event in events:
                if event.startswith("data: "):
                    got.append(event)
                    if len(got) == n:
                        break
        return got

    async def main() -> tuple[list[str], list[str]]:
        a, b = await asyncio.gather(viewer(5), viewer(5))
        await asyncio.sleep(0.1)
        return a, b

    a, b = asyncio.run(main())
    # Both viewers got the same serialized samples, computed once each.
    assert a == b
    assert feed.num_samples <= 6
    assert feed.num_viewers == 0 and feed._task is None  # the sampler stops with the last viewer
    assert len(feed.history) == feed.num_samples


def test_page_is_self_contained() -> None:
    html = page_html()
    assert "/*DASHBOARD_JS*/" not in html and "/*DASHBOARD_CSS*/" not in html
    assert 'id="kv-heatmap"' in html and "new EventSource(" in html
    # Works offline: nothing loaded from anywhere but this server.
    assert "<script src" not in html and "<link rel=\"stylesheet\"" not in html
    assert "http://" not in html and "https://" not in html


# ---------------------------------------------------------------- a live server


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, profile_dir: str) -> Iterator[ServerProcess]:
    args = ["--max-num-seqs", "4", "--api-key", KEY, "--enable-profiling",
            "--profile-dir", profile_dir]
    with ServerProcess(args, model=tiny_model_dir, env={"TAILSERVE_API_KEY": ""}) as srv:
        yield srv


def test_dashboard_needs_the_key(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/dashboard", timeout=10).status_code == 401
    assert httpx.get(server.url + "/dashboard?key=nope", timeout=10).status_code == 401
    page = httpx.get(server.url + f"/dashboard?key={KEY}", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="kv-heatmap"' in page.text
    # ?key= is for the dashboard only; the API still wants the header.
    assert httpx.get(server.url + f"/v1/models?key={KEY}", timeout=10).status_code == 401
    assert httpx.get(server.url + "/dashboard/events?key=nope", timeout=10).status_code == 401


def test_events_stream_samples(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with httpx.stream("GET", server.url + "/dashboard/events", headers=headers,
                      timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and not line.startswith("data: ["):
                samples.append(json.loads(line[6:]))
                if len(samples) == 2:
                    break
    elapsed = time.monotonic() - t0
    assert 0.5 < elapsed < 5  # one a second
    s = samples[-1]
    assert s["running"] == 0 and s["total_blocks"] > 0
    assert len(s["kv_bands"]) == min(32, s["total_blocks"])
    assert s["memory"]["engine_rss"] > 1e6 and s["memory"]["kv_cache"] > 0
    assert s["memory"]["host_total"] >= s["memory"]["host_used"] > 0


class Load:
    """Keeps ``n`` long completions in flight until stopped."""

    def __init__(self, url: str, n: int = 3) -> None:
        self.url, self.n = url, n
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        body = {"prompt": "tell me a long story", "max_tokens": 48, "ignore_eos": True}
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            while not self.stop.is_set():
                r = client.post(self.url + "/v1/completions", json=body)
                if r.status_code != 200:
                    self.errors.append(r.text)
                self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


_RUNNING = "Number(document.getElementById('running').textContent)"
_HEATMAP_PIXELS = """() => {
  const cv = document.getElementById('kv-heatmap');
  const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
  let painted = 0;
  const colours = new Set();
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 0) { painted++; colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]); }
  }
  return [painted, colours.size];
}"""


def test_page_in_a_browser_follows_load(server: ServerProcess, browser: Any) -> None:
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    try:
        page.goto(server.url + f"/dashboard?key={KEY}")
        page.wait_for_function("document.getElementById('status').textContent === 'live'",
                               timeout=10000)
        page.wait_for_function(f"{_RUNNING} === 0", timeout=10000)  # idle, numbers arrived
        with Load(server.url) as load:
            page.wait_for_function(f"{_RUNNING} > 0", timeout=20000)
            painted, colours = page.evaluate(_HEATMAP_PIXELS)
        assert not load.errors, load.errors[:1]
        page.wait_for_function(f"{_RUNNING} === 0", timeout=20000)
        assert load.done > 0
        assert painted > 0, "the heatmap canvas is blank"
        assert colours >= 1
        assert page.text_content("#kv-usage") not in ("–", None)
        assert page.text_content("#ttft") != "– / – ms"  # finished requests reached the page
    finally:
        page.close()
    assert problems == []


def test_span_is_a_noop_outside_a_capture() -> None:
    from tailserve.obs import profiling

    assert profiling.span("forward") is profiling.span("sample")  # one shared null context


def test_profile_capture_has_the_named_ranges(server: ServerProcess, profile_dir: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/debug/profile"
    assert httpx.post(url, params={"seconds": 1}, timeout=10).status_code == 401
    assert httpx.post(url, params={"seconds": 0}, headers=headers, timeout=10).status_code == 400
    with Load(server.url, n=2) as load:
        r = httpx.post(url, params={"seconds": 1.5}, headers=headers, timeout=60)
    assert not load.errors, load.errors[:1]
    assert r.status_code == 200, r.text
    path = r.json()["path"]
    assert os.path.dirname(path) == profile_dir and path.endswith(".json")
    with open(path) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in ("schedule", "prepare_inputs", "forward", "sample", "update"):
        assert phase in names, f"{phase} not in the trace"
    # Idle: the capture still ends on time (the engine checks at every heartbeat).
    t0 = time.monotonic()
    r = httpx.post(url, params={"seconds": 0.5}, headers=headers, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 5


def test_shutdown_ends_open_streams(server: ServerProcess) -> None:
    """Last in this file: it stops the module's server. An open dashboard must not hold up a
    SIGTERM (uvicorn waits for open responses)."""
    ended = threading.Event()

    def watch() -> None:
        with httpx.stream("GET", server.url + f"/dashboard/events?key={KEY}", timeout=30) as r:
            for _ in r.iter_lines():
                pass
        ended.set()

    viewer = threading.Thread(target=watch, daemon=True)
    viewer.start()
    time.sleep(1.5)  # connected, a sample or two received
    server.signal()
    # The drain (nothing in flight) ends the stream at once, not uvicorn's 5 s grace timeout.
    assert ended.wait(3.0)
    assert server.wait(20) == 0
