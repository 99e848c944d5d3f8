"""tailserve bench on the wire: the SSE client against a scripted server, then whole runs
against a live tailserve server (tiny model) and a minimal non-tailserve one, and the errors
a user sees for a wrong URL, a refused connection and a bad key."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rich.console import Console

from server_util import ServerProcess, free_port
from tailserve.bench.client import RequestResult, StreamClient
from tailserve.bench.config import BenchConfig
from tailserve.bench.datasets import DatasetOptions
from tailserve.bench.run import run_bench
from tailserve.cli import main

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------- a scripted server
class FakeServer:
    """An aiohttp server in its own thread and loop; routes are set per test."""

    def __init__(self, routes: dict[tuple[str, str], Handler],
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.routes = routes
        self.ssl_context = ssl_context
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        for (method, path), handler in self.routes.items():
            app.router.add_route(method, path, handler)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port,
                                                     ssl_context=self.ssl_context).start())
        self._started.set()
        self.loop.run_forever()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def sse(script: list[bytes | float], status: int = 200) -> Handler:
    """A handler that writes each bytes item and sleeps for each float."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for item in script:
            if isinstance(item, float):
                await asyncio.sleep(item)
            else:
                await resp.write(item)
        await resp.write_eof()
        return resp

    return handler


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_chunk(content: str | None, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"content": content}
    if role:
        delta["role"] = "assistant"
    return event({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def cmpl_chunk(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3},
               "tailserve_timing": {"queue_s": 0.001}})
DONE = b"data: [DONE]\n\n"


def send_to(handler: Handler, timeout: float | None = 5.0) -> RequestResult:
    with FakeServer({("POST", "/x"): handler}) as srv:

        async def go() -> RequestResult:
            async with aiohttp.ClientSession() as session:
                client = StreamClient(session, srv.url + "/x", {}, timeout)
                res = RequestResult(0, "rid", 5, 3, 0.0)
                await client.send(b"{}", res, perf_counter())
                return res

        return asyncio.run(go())


def test_client_timing_rules() -> None:
    """TTFT waits for content (not the role-only chunk); ITL is the gap between content
    chunks; pings and the usage chunk are not tokens; usage gives the output tokens."""
    res = send_to(sse([
        chat_chunk("", role=True), b": ping\n\n", 0.15, chat_chunk("Hel"), 0.1,
        chat_chunk("lo"), 0.05, chat_chunk("!", "length"), USAGE, DONE,
    ]))
    assert res.success and res.status == 200
    assert res.ttft_s is not None and res.e2el_s is not None
    # Bounds with slack: timers fire to the millisecond, and a loaded machine delays reads.
    assert 0.14 <= res.ttft_s < 0.3
    assert len(res.itl_s) == 2
    assert 0.07 <= res.itl_s[0] < 0.2 and 0.03 <= res.itl_s[1] < 0.15
    assert res.e2el_s >= res.ttft_s + sum(res.itl_s)
    assert (res.text, res.output_tokens, res.output_tokens_source) == ("Hello!", 3, "usage")
    assert res.server_prompt_tokens == 5 and res.server_timing == {"queue_s": 0.001}
    assert res.finish_reason == "length"


def test_client_events_split_across_reads_and_crlf() -> None:
    whole = cmpl_chunk("abc")
    res = send_to(sse([whole[:10], 0.05, whole[10:], cmpl_chunk("d", "stop").replace(
        b"\n\n", b"\r\n\r\n"), DONE]))
    assert res.success and res.text == "abcd" and res.ttft_s is not None and res.ttft_s >= 0.05
    assert res.output_tokens is None  # no usage: step.py fills it from a tokenizer or chunks


@pytest.mark.parametrize("script, error_type", [
    ([cmpl_chunk("a"), event({"error": {"message": "boom", "type": "engine_error"}}), DONE],
     "engine_error"),
    ([DONE], "no_content"),
    ([cmpl_chunk("a")], "incomplete_stream"),
    ([b"data: {not json\n\n"], "bad_json"),
    ([event({"choices": ["not an object"]}), DONE], "bad_response"),
])
def test_client_stream_failures(script: list[bytes | float], error_type: str) -> None:
    res = send_to(sse(script))
    assert not res.success and res.error_type == error_type and res.status == 200
    assert res.e2el_s is None and res.end_s is not None


def test_client_http_error_and_timeout() -> None:
    async def rejected(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "queue is full (8 waiting)",
                                            "type": "rate_limit_exceeded"}}, status=429)

    res = send_to(rejected)
    assert (res.status, res.error_type) == (429, "rate_limit_exceeded")
    assert res.error == "HTTP 429: queue is full (8 waiting)"
    res = send_to(sse([cmpl_chunk("a"), 1.0, DONE]), timeout=0.3)
    assert res.error_type == "timeout" and "--timeout 0.3" in (res.error or "")


# ---------------------------------------------------------------- a live tailserve server
KEY = "s3cret"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    # One server for every live test (a start costs tens of seconds on 2 busy cores); it
    # wants a key, so every run below also shows the key reaching each route.
    with ServerProcess(["--max-num-seqs", "8", "--api-key", KEY], model=tiny_model_dir) as srv:
        yield srv


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=140), buf


def test_live_run_is_consistent(server: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    console, out = _console()
    cfg = BenchConfig(
        base_url=server.url + "/v1", api_key=KEY, request_rate=40.0, seed=1, save_result=str(path),
        dataset=DatasetOptions(num_prompts=12, input_len=32, output_len=8, range_ratio=0.5),
        goodput={"ttft": 60000.0}, metrics_interval_s=0.2, label="ci",
    )
    [step] = run_bench(cfg, console)
    r = json.loads(path.read_text())
    assert r["completed"] == step["completed"] and r["label"] == "ci"
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
                "total_output_tokens", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput"):
        assert key in r, key
    assert (r["backend"], r["num_prompts"], r["request_rate"]) == ("openai", 12, 40.0)
    assert r["completed"] + r["failed"] == 12 and r["failed"] == 0
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s SLO
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9"):
            assert f"{stat}_{m}_ms" in r
        assert r[f"p99_{m}_ms"] >= r[f"p50_{m}_ms"] > 0
        assert r[f"p99.9_{m}_ms"] >= r[f"p99_{m}_ms"]
    assert 1 <= r["max_concurrent_requests"] <= 12

    ts = r["tailserve"]
    reqs = ts["requests"]
    assert len(reqs) == 12 and len({q["request_id"] for q in reqs}) == 12
    assert ts["tokenizer"]["exact"] and "/tokenize" in ts["tokenizer"]["source"]
    for q in reqs:
        # Output tokens are the server's usage, and ignore_eos gave exactly the asked length.
        assert q["output_tokens_source"] == "usage"
        assert q["output_tokens"] == q["output_len"] == q["server_timing"]["output_tokens"]
        # The prompt is as long on the server as the dataset said (its /tokenize counted).
        assert q["server_prompt_tokens"] == q["prompt_len"]
        assert 0 < q["ttft_s"] <= q["e2el_s"]
        assert len(q["itl_s"]) <= q["output_tokens"] - 1
        assert q["send_s"] >= q["scheduled_s"] and q["lag_s"] >= 0
        assert q["status"] == 200 and q["error_type"] is None
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in reqs)
    assert r["total_input_tokens"] == sum(q["prompt_len"] for q in reqs)
    assert ts["lengths"]["input"]["mean"] == pytest.approx(
        sum(q["prompt_len"] for q in reqs) / 12)
    assert ts["failures"] == {"by_status": {}, "by_type": {}, "examples": {}}

    server_side = ts["server"]
    phases = [s["phase"] for s in server_side["metric_samples"]]
    assert phases[0] == "before" and phases[-1] == "after" and "during" in phases
    assert all("tailserve:num_requests_running" in s["values"]
               for s in server_side["metric_samples"])
    # The timeline's request records join ours by x-request-id, with the same token counts.
    by_id = {rec["request_id"]: rec for rec in server_side["timeline"]
             if rec["kind"] == "request"}
    for q in reqs:
        assert by_id[q["request_id"]]["output_tokens"] == q["output_tokens"]
    assert any(rec["kind"] == "step" for rec in server_side["timeline"])
    assert ts["environment"]["server"]["max_model_len"] == 512
    # The server is on this host: the CPU time of the host, the server (this test's child,
    # not counted as the client's) and the client at each sample, for cpu_contention.
    host = server_side["host_cpu_samples"]
    assert host[0]["phase"] == "before" and host[-1]["phase"] == "after"
    assert host[-1]["server_s"] > host[0]["server_s"] and host[-1]["ncpu"] == os.cpu_count()
    assert "host_cpu_why_not" not in server_side

    text = out.getvalue()
    assert "in flight" in text and "failed" in text  # the live progress bar
    assert "TTFT" in text and "Successful requests" in text and "lengths sent" in text


def test_live_chat_steps_with_failures(server: ServerProcess, tmp_path: Path) -> None:
    """Half the requests are longer than max_model_len (512): they fail with 400, are
    counted by status and type, and every step still reports and saves."""
    path = tmp_path / "steps.json"
    cfg = BenchConfig(
        base_url=server.url, api_key=KEY, endpoint="chat", request_rates=[20.0, float("inf")],
        save_result=str(path), observe=False, progress=False, warmup=2,
        dataset=DatasetOptions(name="mixed", num_prompts=8, mix="16:0.5,600:0.5",
                               output_len=4),
    )
    steps = run_bench(cfg, _console()[0])
    summary = json.loads(path.read_text())
    assert [row["step"] for row in summary["steps"]] == ["20 req/s", "inf"]
    assert Path(summary["plot"]).read_text().startswith("<svg")
    for row, step in zip(summary["steps"], steps, strict=True):
        r = json.loads(Path(row["result_file"]).read_text())
        assert r["backend"] == "openai-chat"
        long = sum(q["prompt_len"] >= 600 for q in r["tailserve"]["requests"])
        assert 0 < long < 8
        assert (r["completed"], r["failed"]) == (8 - long, long)
        failures = r["tailserve"]["failures"]
        assert failures["by_status"] == {"400": long}
        assert failures["by_type"] == {"invalid_request_error": long}
        assert any("max_model_len" in w for w in r["tailserve"]["warnings"])
        assert "server" not in r["tailserve"]  # --no-observe
        assert step["completed"] == r["completed"]


def test_live_sweep(server: ServerProcess) -> None:
    # Without SLOs (none given, the server's own ignored) the sweep spans the two ends;
    # with them it searches the capacity (test_goodput.py).
    cfg = BenchConfig(base_url=server.url, api_key=KEY, sweep=True, sweep_steps=1, observe=False,
                      progress=False, server_slos=False,
                      dataset=DatasetOptions(num_prompts=6, input_len=16, output_len=6))
    sync, peak, mid = run_bench(cfg, _console()[0])
    assert [s["tailserve"]["step"]["name"] for s in (sync, peak)] == ["synchronous", "throughput"]
    assert sync["max_concurrent_requests"] == 1 and sync["max_concurrency"] == 1
    assert peak["max_concurrent_requests"] > 1
    lo, hi = sync["request_throughput"], peak["request_throughput"]
    assert mid["request_rate"] == pytest.approx((lo + hi) / 2)


# ---------------------------------------------------------------- a non-tailserve server
def test_other_server_has_no_tailserve_parts(tmp_path: Path) -> None:
    """Only /v1/models and a completions stream without usage: lengths are estimated (and
    the result says so), output tokens are counted in chunks, the server parts are absent."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "other"}]})

    stream = sse([cmpl_chunk("a"), cmpl_chunk("b"), cmpl_chunk("c", "length"), DONE])
    path = tmp_path / "r.json"
    with FakeServer({("GET", "/v1/models"): models,
                     ("POST", "/v1/completions"): stream}) as srv:
        rc = main(["bench", "--base-url", srv.url, "--num-prompts", "5", "--input-len", "20",
                   "--no-progress", "--save-result", str(path)])
    assert rc == 0
    r = json.loads(path.read_text())
    assert (r["model_id"], r["completed"], r["total_output_tokens"]) == ("other", 5, 15)
    ts = r["tailserve"]
    assert "server" not in ts and not ts["tokenizer"]["exact"]
    assert any("estimates" in w for w in ts["warnings"])
    assert {q["output_tokens_source"] for q in ts["requests"]} == {"chunks"}
    assert all(q["server_timing"] is None for q in ts["requests"])


def test_ctrl_c_reports_what_was_sent(tmp_path: Path) -> None:
    """Ctrl-C stops sending; the step still reports and saves the requests it sent, those in
    flight as failed (cancelled); the exit status is 130."""
    seen = 0

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal seen
        seen += 1
        if seen == 8:  # the test request, then 7 of the run's: press Ctrl-C
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, os.kill, os.getpid(), signal.SIGINT)
        # The test request and the run's first two finish at once; the rest hang.
        return await sse([cmpl_chunk("a"), *([] if seen <= 3 else [1.5]),
                          cmpl_chunk("b", "length"), DONE])(request)

    path = tmp_path / "r.json"
    # A test run started in the background (`make test &`, `nohup ... &`) inherits SIGINT as
    # ignored, and asyncio then (rightly) leaves it ignored: give this test the handler an
    # interactive terminal has, so it tests Ctrl-C however pytest was launched.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with FakeServer({("GET", "/v1/models"): models,
                         ("POST", "/v1/completions"): completions}) as srv:
            rc = main(["bench", "--base-url", srv.url, "--num-prompts", "200",
                       "--request-rate", "40", "--input-len", "4", "--no-progress",
                       "--save-result", str(path)])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert rc == 130
    r = json.loads(path.read_text())
    assert r["tailserve"]["interrupted"]
    sent = r["num_prompts"]
    assert 7 <= sent < 200 and len(r["tailserve"]["requests"]) == sent
    assert (r["completed"], r["failed"]) == (2, sent - 2)
    assert r["tailserve"]["failures"]["by_type"] == {"cancelled": sent - 2}
    assert any("interrupted" in w for w in r["tailserve"]["warnings"])


# ---------------------------------------------------------------- what the user sees
def _bench_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["bench", "--num-prompts", "2", "--no-progress", *args]) == 2
    return capsys.readouterr().err


def test_wrong_url_refused_connection_unknown_model(server: ServerProcess,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    err = _bench_error(capsys, "--base-url", f"http://127.0.0.1:{port}")
    assert f"connection refused at 127.0.0.1:{port}" in err and "Is the server running" in err
    err = _bench_error(capsys, "--base-url", server.url + "/wrong/path", "--api-key", KEY)
    assert "answered 404" in err and "--base-url wants the server root" in err
    err = _bench_error(capsys, "--base-url", "localhost:8000")
    assert "--base-url must look like http://HOST:PORT" in err
    err = _bench_error(capsys, "--base-url", server.url, "--api-key", KEY, "--model", "gpt-9")
    assert "does not serve model 'gpt-9'" in err and "llama" in err
    err = _bench_error(capsys, "--base-url", server.url, "--api-key", KEY, "--goodput", "ttft")
    assert "--goodput wants NAME:MS" in err
    assert "Traceback" not in err


def test_api_key(server: ServerProcess, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("TAILSERVE_API_KEY", raising=False)
    err = _bench_error(capsys, "--base-url", server.url, "--api-key", "wrong")
    assert "refused the request (HTTP 401" in err and "--api-key" in err
    assert "is not accepted" in err
    err = _bench_error(capsys, "--base-url", server.url)
    assert "wants an API key" in err
    # The key from the environment, as the openai client and vLLM's bench read it.
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert main(["bench", "--base-url", server.url, "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--no-progress", "--no-observe"]) == 0
