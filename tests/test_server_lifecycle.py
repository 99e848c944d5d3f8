"""Live-server lifecycle tests: abort storm, client disconnect, overload (429), SIGTERM drain
(503, finish_reason "abort", exit 0), a killed server's engine, and an engine fault (500
engine_error, /health 503, non-zero exit). Real ``tailserve serve`` processes, real HTTP on
loopback; no mocks.

The tiny random model's tokens are random, so every request sets ``ignore_eos`` and its
length is ``max_tokens``. A second tiny model with an 8192-token context makes requests that
cannot finish by themselves within the windows these tests look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest

from fault_site.fault_injection import fault_env
from server_util import ServerProcess, metric_value

LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-long") / "llama", max_position_embeddings=LONG_CONTEXT
    )


# ---------------------------------------------------------------------------- helpers
def completion(
    max_tokens: int, stream: bool = False, prompt: str = "Hello there"
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class StreamResult:
    status: int
    events: list[Any] = field(default_factory=list)  # decoded JSON payloads, in order
    done: bool = False  # saw "data: [DONE]"
    cancelled: bool = False  # the client closed the stream on purpose
    body: bytes = b""  # a non-200 answer's body

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"] for e in self.events for c in e.get("choices", ())
            if c.get("finish_reason")
        ]

    @property
    def usage(self) -> dict[str, int] | None:
        last = [e["usage"] for e in self.events if e.get("usage")]
        return last[-1] if last else None

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if "error" in e]


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    cancel_after: int | None = None,
    first_chunk: asyncio.Event | None = None,
) -> StreamResult:
    """POST a streamed completion and read its SSE events; with ``cancel_after``, close the
    connection after that many events (leaving the ``async with`` closes it mid-response)."""
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        res = StreamResult(resp.status_code)
        if resp.status_code != 200:
            res.body = await resp.aread()
            return res
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                res.done = True
                continue
            res.events.append(json.loads(data))
            if first_chunk is not None:
                first_chunk.set()
            if cancel_after is not None and len(res.events) >= cancel_after:
                res.cancelled = True
                break
    return res


async def poll_metrics(
    client: httpx.AsyncClient, url: str, ready: Callable[[str], bool], timeout: float
) -> str:
    """Poll /metrics until ``ready(text)``; return the last text either way."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get(url + "/metrics")).text
        if ready(text) or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.05)


def engine_idle(text: str) -> bool:
    free = metric_value(text, "tailserve:kv_cache_free_blocks")
    total = metric_value(text, "tailserve:kv_cache_total_blocks")
    return (
        metric_value(text, "tailserve:num_requests_running") == 0
        and metric_value(text, "tailserve:num_requests_waiting") == 0
        and total is not None and total > 0 and free == total
    )


def idle_summary(text: str) -> dict[str, float | None]:
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks",
             "kv_cache_total_blocks")
    return {n: metric_value(text, "tailserve:" + n) for n in names}


def assert_openai_error(body: Any, type_: str, code: str | None = None) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == type_, err
    assert isinstance(err["message"], str) and err["message"], err
    if code is not None:
        assert err["code"] == code, err


_TRACE_TEXT = re.compile(r"Traceback|File \"|\.py\b|line \d+|0x[0-9a-fA-F]{6,}")


def assert_no_trace_text(text: str) -> None:
    found = _TRACE_TEXT.search(text)
    assert found is None, f"traceback-like text {found.group(0)!r} in {text!r}"


def engine_process(srv: ServerProcess) -> psutil.Process:
    """The engine child (spawned by multiprocessing), not its resource tracker."""
    assert srv.proc is not None
    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        cmd = " ".join(child.cmdline())
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            return child
    raise AssertionError("no engine process under the server")


def assert_no_engine_left(srv: ServerProcess, engine_pid: int) -> None:
    """The server reaps its engine before it exits; its other helpers (multiprocessing's
    resource tracker) follow their parent out within moments."""
    assert not psutil.pid_exists(engine_pid), f"engine {engine_pid} outlived the server"
    deadline = time.monotonic() + 5.0
    while srv.leftover_engines() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = []
    for pid in srv.leftover_engines():
        with contextlib.suppress(psutil.Error):
            left.append((pid, psutil.Process(pid).cmdline()))
    assert left == [], left


@contextlib.contextmanager
def serving(
    args: list[str], model: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A server for one test; its output is printed (pytest shows it) when the test fails."""
    with ServerProcess(args, model=model, env=env) as srv:
        try:
            yield srv
        except BaseException:
            print(srv.output())
            raise


# ---------------------------------------------------------------------------- one server
@pytest.fixture(scope="module")
def long_server(long_model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess([], model=long_model_dir) as srv:
        yield srv
        # An idle server stops cleanly on SIGTERM too.
        engine_pid = engine_process(srv).pid
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=30) == 0, srv.output()
        assert_no_engine_left(srv, engine_pid)


def test_abort_storm_frees_everything(long_server: ServerProcess) -> None:
    """100 concurrent streams, half of them closed by the client at random points (some before
    their first chunk, while still waiting for a slot): the other half complete in full, and
    afterwards the engine holds no request and every KV block is free."""
    url = long_server.url
    rng = random.Random(1234)
    n = 100
    # (max_tokens, close after this many events | None, close after this many seconds | None)
    plan: list[tuple[int, int | None, float | None]] = []
    for i in range(n):
        max_tokens = rng.randint(100, 250)
        if i % 2 == 0:
            plan.append((max_tokens, None, None))
        elif i % 10 == 1:
            plan.append((max_tokens, None, rng.uniform(0.0, 0.5)))
        else:
            plan.append((max_tokens, rng.randint(1, 40), None))

    async def one(
        client: httpx.AsyncClient, max_tokens: int, after_events: int | None,
        after_s: float | None,
    ) -> StreamResult | None:
        call = stream_completion(
            client, url, completion(max_tokens, stream=True), cancel_after=after_events
        )
        if after_s is None:
            return await call
        try:
            return await asyncio.wait_for(call, after_s)  # cancelling closes the connection
        except asyncio.TimeoutError:
            return None

    async def run() -> tuple[list[StreamResult | None], str]:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            results = await asyncio.gather(*[one(client, *p) for p in plan])
            text = await poll_metrics(client, url, engine_idle, timeout=2.0)
        return list(results), text

    results, text = asyncio.run(run())
    for (max_tokens, after_events, after_s), res in zip(plan, results, strict=True):
        if after_s is not None:
            continue  # closed at a random moment: nothing to check on the client side
        assert res is not None and res.status == 200, res
        if after_events is not None:
            # Outputs already queued go out as one chunk (GenerationState.next_outputs), so on
            # a loaded server a stream can end in fewer events than the client meant to read
            # before hanging up; then it must have ended whole.
            if not res.cancelled:
                assert res.done and len(res.events) < after_events, res.events[-2:]
                assert res.finish_reasons == ["length"], res.finish_reasons
                continue
            assert not res.done
            continue
        assert res.done, res.events[-3:]
        assert res.finish_reasons == ["length"], res.finish_reasons
        assert res.usage is not None and res.usage["completion_tokens"] == max_tokens
        assert res.events[-1]["tailserve_timing"]["output_tokens"] == max_tokens
        assert res.errors == []
    assert engine_idle(text), idle_summary(text)
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def aborts(text: str, reason: str) -> float | None:
    return metric_value(text, "tailserve:request_aborts_total", {"reason": reason})


def success(text: str, finish_reason: str) -> float | None:
    return metric_value(
        text, "tailserve:request_success_total", {"finished_reason": finish_reason}
    )


def test_a_disconnect_storm_is_counted_and_recorded(long_model_dir: str) -> None:
    """40 streaming clients that hang up after their first chunk: exactly 40 aborts by
    client_disconnect in /metrics (and in request_success_total{finished_reason="abort"}),
    40 timeline records with their timing, and every block free afterwards."""
    n = 40
    with serving(["--max-num-seqs", "8"], long_model_dir) as srv:
        url = srv.url

        async def run() -> tuple[list[StreamResult], str]:
            limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                results = await asyncio.gather(*[
                    stream_completion(client, url, completion(LONG_CONTEXT - 64, stream=True),
                                      cancel_after=1)
                    for _ in range(n)
                ])
                text = await poll_metrics(
                    client, url,
                    lambda t: engine_idle(t) and aborts(t, "client_disconnect") == n,
                    timeout=10.0,
                )
            return list(results), text

        results, text = asyncio.run(run())
        assert all(r.status == 200 and r.cancelled for r in results)
        assert engine_idle(text), idle_summary(text)
        assert aborts(text, "client_disconnect") == n
        assert success(text, "abort") == n
        assert success(text, "length") == 0 and success(text, "stop") == 0
        for reason in ("stop_string", "drain", "engine_error", "server_error"):
            assert aborts(text, reason) == 0, reason
        records = [
            r for r in httpx.get(url + "/debug/timeline", timeout=10).json()["records"]
            if r["kind"] == "request"
        ]
        assert len(records) == n
        for r in records:
            assert (r["finish_reason"], r["abort_reason"]) == ("abort", "client_disconnect")
            assert r["output_tokens"] >= 1 and r["prompt_tokens"] >= 1
            # Its timing, from the API's clock: arrival <= first token <= the hang-up.
            assert r["arrival_time"] <= r["first_token_time"] <= r["finished_time"], r


def test_a_client_gone_before_its_stream_began_is_aborted(long_server: ServerProcess) -> None:
    """Streaming clients that hang up after their request reached the engine but before its
    first output came back: the handler gets the first output before its next disconnect poll
    and hands Starlette a streaming response for a client that is gone. Their engine requests
    must still be aborted at once and counted as client disconnects, not left generating
    thousands of tokens for nobody. (With uvicorn's ASGI spec 2.3 the body still starts and
    its own cleanup aborts; where the body never starts, ``GenerationStream`` does:
    test_server_streaming.py.)"""
    url = long_server.url
    host, port = "127.0.0.1", long_server.port
    engine = engine_process(long_server)
    n = 8
    payload = json.dumps(completion(LONG_CONTEXT - 64, stream=True)).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
           + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    async def run() -> tuple[str, str]:
        async with httpx.AsyncClient(timeout=30) as client:
            before = await poll_metrics(client, url, engine_idle, timeout=5.0)
            assert engine_idle(before), idle_summary(before)
            expected = (aborts(before, "client_disconnect") or 0) + n
            # The engine held still, so every request waits for its first output; the clients
            # hang up and the engine resumes at once: the outputs arrive within a few ms,
            # before most handlers' next disconnect poll (every 0.1 s).
            engine.suspend()
            try:
                writers = []
                for _ in range(n):
                    _, writer = await asyncio.open_connection(host, port)
                    writer.write(raw)
                    await writer.drain()
                    writers.append(writer)
                await asyncio.sleep(0.5)  # every request is in the engine's inbox
                for writer in writers:
                    writer.close()
            finally:
                engine.resume()
            after = await poll_metrics(
                client, url,
                lambda t: engine_idle(t) and aborts(t, "client_disconnect") == expected,
                timeout=3.0,
            )
        return before, after

    before, after = asyncio.run(run())
    assert engine_idle(after), idle_summary(after)
    assert aborts(after, "client_disconnect") == (aborts(before, "client_disconnect") or 0) + n
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_a_stop_string_is_counted_as_the_reason_its_request_ended(
    long_server: ServerProcess,
) -> None:
    """A stop string matched in the text ends the engine request from the API: finish_reason
    "stop" (it succeeded), request_aborts_total{reason="stop_string"} counts it."""
    url = long_server.url
    before = httpx.get(url + "/metrics", timeout=10).text
    # The tiny model's greedy text for this prompt, then a stop at one of its characters.
    body = completion(24)
    text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = text[3:5]
    r = httpx.post(url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop", r
    after = httpx.get(url + "/metrics", timeout=10).text
    assert aborts(after, "stop_string") == (aborts(before, "stop_string") or 0) + 1
    assert success(after, "stop") == (success(before, "stop") or 0) + 1
    assert aborts(after, "client_disconnect") == aborts(before, "client_disconnect")


def test_non_streamed_disconnect_aborts_in_engine(long_server: ServerProcess) -> None:
    """A non-streamed request whose client hangs up is aborted in the engine (blocks freed)
    while it still has thousands of tokens to go."""
    url = long_server.url
    host, port = "127.0.0.1", long_server.port

    def running(text: str) -> float | None:
        return metric_value(text, "tailserve:num_requests_running")

    async def run() -> tuple[str, float, str]:
        async with httpx.AsyncClient(timeout=30) as client:
            before = await poll_metrics(client, url, engine_idle, timeout=5.0)
            assert engine_idle(before), idle_summary(before)
            # A raw socket, so "close the connection" means exactly that.
            _, writer = await asyncio.open_connection(host, port)
            payload = json.dumps(completion(LONG_CONTEXT - 64)).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
            )
            await writer.drain()
            busy = await poll_metrics(client, url, lambda t: running(t) == 1, timeout=10.0)
            assert running(busy) == 1, idle_summary(busy)
            writer.close()
            await writer.wait_closed()
            closed_at = time.monotonic()
            after = await poll_metrics(client, url, engine_idle, timeout=3.0)
            idle_after = time.monotonic() - closed_at
            # And it stays stopped: no more tokens are generated for it.
            await asyncio.sleep(0.3)
            later = (await client.get(url + "/metrics")).text
        return after, idle_after, later

    before = httpx.get(url + "/metrics", timeout=10).text
    after, idle_after, later = asyncio.run(run())
    assert engine_idle(after), idle_summary(after)
    # Counted once, as the client's doing.
    assert aborts(after, "client_disconnect") == (aborts(before, "client_disconnect") or 0) + 1
    assert idle_after < 1.0, f"the engine ran the request {idle_after:.2f} s past the hang-up"
    generated = metric_value(later, "tailserve:generation_tokens_total")
    assert generated == metric_value(after, "tailserve:generation_tokens_total")
    assert httpx.get(url + "/health", timeout=5).status_code == 200


# ---------------------------------------------------------------------------- overload
def test_overload_sheds_with_429(tiny_model_dir: str) -> None:
    """max_num_seqs 2 + max_queue_len 4: a burst of 50 gets 429s (Retry-After, OpenAI body)
    before any admitted request finishes, and every admitted request completes in full."""
    n, max_tokens = 50, 128
    with serving(["--max-num-seqs", "2", "--max-queue-len", "4"], tiny_model_dir) as srv:
        url = srv.url

        async def one(client: httpx.AsyncClient, i: int) -> tuple[httpx.Response, float]:
            resp = await client.post(
                url + "/v1/completions", json=completion(max_tokens, prompt=f"request {i}")
            )
            return resp, time.monotonic()

        async def run() -> list[tuple[httpx.Response, float]]:
            limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                return list(await asyncio.gather(*[one(client, i) for i in range(n)]))

        results = asyncio.run(run())
        text = httpx.get(url + "/metrics", timeout=5).text
        health = httpx.get(url + "/health", timeout=5).status_code

    rejected = [(r, t) for r, t in results if r.status_code == 429]
    admitted = [(r, t) for r, t in results if r.status_code != 429]
    assert all(r.status_code == 200 for r, _ in admitted), [
        (r.status_code, r.text) for r, _ in admitted if r.status_code != 200
    ]
    # Capacity is 2 running + 4 waiting; the whole burst lands before any of it finishes.
    assert len(admitted) == 6, [r.status_code for r, _ in results]
    for r, _ in admitted:
        body = r.json()
        assert body["usage"]["completion_tokens"] == max_tokens
        assert body["choices"][0]["finish_reason"] == "length"
    for r, _ in rejected:
        assert r.headers.get("retry-after", "").isdigit(), dict(r.headers)
        assert int(r.headers["retry-after"]) >= 1
        assert_openai_error(r.json(), "rate_limit_error", "queue_full")
        assert r.headers.get("x-request-id")
    # Shedding is immediate: every 429 arrived before the first admitted request finished.
    assert max(t for _, t in rejected) < min(t for _, t in admitted)
    assert metric_value(
        text, "tailserve:requests_rejected_total", {"reason": "queue_full"}
    ) == len(rejected)
    assert health == 200


# ---------------------------------------------------------------------------- bounded
# Issue 18: a failed hand-off leaks no slot, an impossible request is a 400 (not a 429 clients
# retry forever). max_num_seqs 4 + max_queue_len 8: twelve sequences at once.
BOUNDED_CAPACITY = 12


def post_raw(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """JSON as a client writes it (``\\udfff`` stays an escape; httpx's own encoder would
    refuse the lone surrogate before sending)."""
    return client.post(path, content=json.dumps(body),
                       headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def bounded_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    with serving(["--max-num-seqs", "4", "--max-queue-len", "8"], tiny_model_dir) as srv:
        yield srv
        # Nothing is left counted in flight, so SIGTERM has nothing to wait for (a leaked
        # request held it for the whole 30 s shutdown_timeout, then 5 s more).
        engine_pid = engine_process(srv).pid
        t0 = time.monotonic()
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=30) == 0, srv.output()
        assert time.monotonic() - t0 < 10.0
        assert_no_engine_left(srv, engine_pid)


def assert_all_slots_free(client: httpx.Client) -> None:
    """Idle, healthy, and one request of exactly the whole capacity is admitted and served."""
    text = client.get("/metrics").text
    assert engine_idle(text), idle_summary(text)
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={**completion(2), "n": BOUNDED_CAPACITY})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(BOUNDED_CAPACITY))
    assert r.json()["usage"]["completion_tokens"] == 2 * BOUNDED_CAPACITY


def test_requests_that_can_never_be_admitted_are_400(bounded_server: ServerProcess) -> None:
    """More sequences than max_num_seqs + max_queue_len is a 400 naming the numbers, on an
    idle server, with no Retry-After; exactly the capacity is served; the openai SDK gets a
    BadRequestError at once instead of retrying."""
    import openai

    limit = ("this server holds at most 12 sequences at once (max_num_seqs 4 + max_queue_len "
             "8), so the request can never be admitted")
    with httpx.Client(base_url=bounded_server.url, timeout=60) as client:
        cases = [
            ("/v1/completions", {**completion(2), "n": 13}, "n", f"n is 13 but {limit}"),
            ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 16},
             "n", f"n is 16 but {limit}"),
            ("/v1/completions", {**completion(2), "prompt": ["a", "b", "c"], "n": 5}, "prompt",
             f"3 prompts with n 5 make 15 sequences but {limit}"),
        ]
        for path, body, param, message in cases:
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            assert "retry-after" not in r.headers, dict(r.headers)
            assert_openai_error(r.json(), "invalid_request_error")
            assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
        sdk = openai.OpenAI(base_url=bounded_server.url + "/v1", api_key="unused", max_retries=5)
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model="llama", prompt="hi", n=13, max_tokens=2)
        assert e.value.status_code == 400
        assert_all_slots_free(client)
        text = client.get("/metrics").text
    assert metric_value(
        text, "tailserve:requests_rejected_total", {"reason": "queue_full"}
    ) in (None, 0)


def test_a_failed_hand_off_leaks_no_slot(bounded_server: ServerProcess) -> None:
    """Twelve requests at once with a lone surrogate as stop string: each is a 400 naming
    "stop" (it used to be a 500 that left its slot counted, so every later request got 429);
    afterwards all twelve slots are free."""
    async def burst() -> list[httpx.Response]:
        body = json.dumps({**completion(8), "stop": ["\udfff"]})
        async with httpx.AsyncClient(base_url=bounded_server.url, timeout=60) as client:
            return list(await asyncio.gather(*[
                client.post("/v1/completions", content=body,
                            headers={"content-type": "application/json"})
                for _ in range(BOUNDED_CAPACITY)
            ]))

    for r in asyncio.run(burst()):
        assert r.status_code == 400, r.text
        assert_openai_error(r.json(), "invalid_request_error")
        assert r.json()["error"]["param"] == "stop"
        assert r.json()["error"]["message"] == (
            "stop[0] contains a lone surrogate (U+DFFF) at index 0; text must be valid Unicode"
        )
    with httpx.Client(base_url=bounded_server.url, timeout=60) as client:
        r = client.post("/v1/completions", json=completion(4))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert_all_slots_free(client)
    assert "Traceback" not in bounded_server.output(), bounded_server.output()


def test_a_full_server_refuses_before_reading_the_body(bounded_server: ServerProcess) -> None:
    """Full (one streamed request of n = the whole capacity): a request that has sent only its
    headers, announcing a 100 kB body, gets its 429 (Retry-After, x-request-id, counted as
    queue_full) without sending a byte of the body. The capacity comes back when the stream
    is closed."""
    url = bounded_server.url

    async def run() -> tuple[bytes, float, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            before = (await client.get(url + "/metrics")).text
            started = asyncio.Event()
            body = {**completion(400, stream=True), "n": BOUNDED_CAPACITY}
            stream = asyncio.create_task(
                stream_completion(client, url, body, first_chunk=started)
            )
            await asyncio.wait_for(started.wait(), 30)
            reader, writer = await asyncio.open_connection("127.0.0.1", bounded_server.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.close()
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream
            after = await poll_metrics(client, url, engine_idle, timeout=5.0)
        rejected = "tailserve:requests_rejected_total"
        return (head,
                metric_value(before, rejected, {"reason": "queue_full"}) or 0,
                metric_value(after, rejected, {"reason": "queue_full"}) or 0)

    head, before, after = asyncio.run(run())
    lines = head.decode().lower().split("\r\n")
    assert lines[0] == "http/1.1 429 too many requests", head
    assert "retry-after: 1" in lines and any(h.startswith("x-request-id: ") for h in lines), head
    assert after == before + 1
    with httpx.Client(base_url=url, timeout=60) as client:
        assert_all_slots_free(client)


# ---------------------------------------------------------------------------- SIGTERM drain
def test_sigterm_drain(long_model_dir: str, tmp_path: Any) -> None:
    """SIGTERM with --shutdown-timeout 3: new work gets 503 and /health 503 at once; in-flight
    requests that end within the timeout finish normally ("length", every token); the ones
    still running at the timeout end with finish_reason "abort" and [DONE]; the server exits
    0 and leaves no engine behind. The engine gets its SIGTERM too, as from a supervisor that
    signals the whole service (systemd's KillMode=control-group): the drain must survive it."""
    timeout_s, short_tokens, long_tokens = 3.0, 32, LONG_CONTEXT - 64
    timeline = tmp_path / "timeline.jsonl"
    with serving(["--shutdown-timeout", str(timeout_s), "--timeline", str(timeline)],
                 long_model_dir) as srv:
        url = srv.url
        engine = engine_process(srv)
        engine_pid = engine.pid

        async def run() -> tuple[
            list[StreamResult], list[float], httpx.Response, httpx.Response
        ]:
            async with httpx.AsyncClient(timeout=60) as client:
                lengths = [long_tokens, short_tokens, long_tokens, short_tokens]
                started = [asyncio.Event() for _ in lengths]
                ended: list[float] = [0.0] * len(lengths)

                async def one(i: int) -> StreamResult:
                    res = await stream_completion(
                        client, url, completion(lengths[i], stream=True), first_chunk=started[i]
                    )
                    ended[i] = time.monotonic()
                    return res

                streams = [asyncio.create_task(one(i)) for i in range(len(lengths))]
                await asyncio.wait_for(asyncio.gather(*[ev.wait() for ev in started]), 30)
                srv.signal(signal.SIGTERM)
                engine.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.2)
                refused = await client.post(url + "/v1/completions", json=completion(8))
                health = await client.get(url + "/health")
                results = await asyncio.wait_for(asyncio.gather(*streams), 30)
                return list(results), [t - signalled for t in ended], refused, health

        results, ended_after, refused, health = asyncio.run(run())
        code = srv.wait(timeout=30)
        log = srv.output()
    print(log)  # shown when the test fails

    assert refused.status_code == 503, refused.text
    assert_openai_error(refused.json(), "service_unavailable", "draining")
    assert health.status_code == 503, health.text
    assert_openai_error(health.json(), "service_unavailable", "draining")
    long, short = results[0::2], results[1::2]
    for res in short:
        assert res.status == 200 and res.done and res.errors == []
        assert res.finish_reasons == ["length"], res.finish_reasons
        assert res.usage is not None and res.usage["completion_tokens"] == short_tokens
    assert max(ended_after[1::2]) < timeout_s  # they did not wait for the long ones
    for res in long:
        assert res.status == 200 and res.errors == []
        assert res.finish_reasons == ["abort"], (res.finish_reasons, res.events[-2:])
        assert res.done, res.events[-2:]
        usage = res.usage
        assert usage is not None and 0 < usage["completion_tokens"] < long_tokens
        assert res.events[-1]["tailserve_timing"]["output_tokens"] == usage["completion_tokens"]
    # The long streams ran until the shutdown timeout, not less.
    assert min(ended_after[0::2]) >= timeout_s - 0.1, ended_after
    # The timeline says why each request ended: the two long ones by the drain.
    records = [json.loads(line) for line in timeline.read_text().splitlines()]
    ends = sorted((r["finish_reason"], r["abort_reason"]) for r in records
                  if r["kind"] == "request")
    assert ends == [("abort", "drain")] * 2 + [("length", None)] * 2, ends
    assert code == 0
    assert "Traceback" not in log
    assert_no_engine_left(srv, engine_pid)


def test_engine_does_not_outlive_a_killed_server(long_model_dir: str) -> None:
    """SIGKILL gives the server no chance to stop its engine; a busy engine notices that its
    parent is gone and exits by itself instead of running on as an orphan."""
    with serving([], long_model_dir) as srv:
        engine = engine_process(srv)

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(stream_completion(
                    client, srv.url, completion(LONG_CONTEXT - 64, stream=True),
                    first_chunk=started,
                ))
                await asyncio.wait_for(started.wait(), 30)
                srv.signal(signal.SIGKILL)
                with contextlib.suppress(httpx.HTTPError):
                    await asyncio.wait_for(stream, 30)

        asyncio.run(run())
        assert srv.wait(timeout=10) == -signal.SIGKILL
        try:
            engine.wait(timeout=10)  # not our child: psutil polls for it to be gone
        except psutil.TimeoutExpired:
            pytest.fail(f"the engine {engine.pid} kept running after its server was killed")


# ---------------------------------------------------------------------------- engine death
def test_requests_after_the_engine_died_are_503_at_once(tiny_model_dir: str) -> None:
    """The engine process is killed. As soon as /health reports it gone (the process has
    exited), new requests are refused with 503 engine_dead, also before the watchdog's next
    tick declares the death (they used to be admitted, sent into the void and answered 500
    engine_error a moment later)."""
    with serving([], tiny_model_dir) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.post("/v1/completions", json=completion(2)).status_code == 200
        engine = engine_process(srv)
        engine.kill()
        # The kernel takes a moment to tear a many-threaded process down; /health sees the
        # exit as soon as the server can reap it.
        deadline = time.monotonic() + 10.0
        while client.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.002)
        refused = [client.post("/v1/completions", json=completion(2)) for _ in range(3)]
        code = srv.wait(timeout=30)
    for r in refused:
        assert r.status_code == 503, [x.text for x in refused]
        assert_openai_error(r.json(), "service_unavailable", "engine_dead")
        assert r.json()["error"]["message"] == (
            "the engine is not running: the engine process exited (exit code -9)"
        )
    assert code == 1


# ---------------------------------------------------------------------------- engine fault
def test_engine_fault_gives_500_then_unhealthy_and_exit(tiny_model_dir: str) -> None:
    """The forward raises at step 5 (a fault injected by fault_site/fault_injection.py). A
    non-streamed request in flight gets a 500 engine_error, a streamed one an error event;
    /health turns 503, new requests get 503, and the server exits non-zero by itself with no
    engine left behind."""
    env = fault_env(fail_forward_at_step=5)
    with serving([], tiny_model_dir, env) as srv:
        url = srv.url
        engine = engine_process(srv)
        engine_pid = engine.pid

        async def run() -> tuple[httpx.Response, StreamResult, list[int], httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                # Hold the engine still so both requests are in it before its first step.
                engine.suspend()
                try:
                    plain = asyncio.create_task(
                        client.post(url + "/v1/completions", json=completion(100))
                    )
                    streamed = asyncio.create_task(
                        stream_completion(client, url, completion(100, stream=True))
                    )
                    await asyncio.sleep(0.5)  # both reach the engine's inbox
                    assert not plain.done() and not streamed.done()
                finally:
                    engine.resume()
                resp = await asyncio.wait_for(plain, 30)
                stream = await asyncio.wait_for(streamed, 30)
                statuses: list[int] = []
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:
                    statuses.append((await client.get(url + "/health")).status_code)
                    if statuses[-1] == 503:
                        break
                    await asyncio.sleep(0.05)
                refused = await client.post(url + "/v1/completions", json=completion(8))
                return resp, stream, statuses, refused

        resp, stream, statuses, refused = asyncio.run(run())
        code = srv.wait(timeout=30)
        log = srv.output()
    print(log)  # shown when the test fails

    assert resp.status_code == 500, resp.text
    assert_openai_error(resp.json(), "engine_error")
    assert_no_trace_text(resp.text)
    assert stream.status == 200, stream.body
    assert stream.events[0]["choices"], stream.events  # it was streaming before the fault
    assert len(stream.errors) == 1 and stream.done, stream.events
    assert stream.errors[0]["type"] == "engine_error"
    assert_no_trace_text(json.dumps(stream.errors))
    assert stream.finish_reasons == []  # it did not pretend to finish normally
    assert statuses[-1] == 503, statuses
    assert refused.status_code == 503, refused.text
    assert_openai_error(refused.json(), "service_unavailable", "engine_dead")
    assert code > 0  # an exit status, not death by a signal
    assert_no_engine_left(srv, engine_pid)
    # The operator's log names the cause: the engine's one traceback, none from the API side.
    assert "injected forward failure" in log, log
    assert log.count("Traceback") == 1 and "Exception in ASGI application" not in log, log
