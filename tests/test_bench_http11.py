"""The bench's lean HTTP/1.1 client (bench/http11.py) on real loopback sockets: streaming and
non-streaming bodies, chunked and Content-Length framing, error bodies, refused connections,
servers that close or reset mid-response, keep-alive reuse and timeouts; for every case the
same result as the aiohttp client on the same server. Then whole runs: lean against aiohttp,
``--tokenizer PATH`` end to end, and https (aiohttp) against a TLS responder."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from server_util import free_port
from tailserve.bench.client import BenchClient, RequestResult, StreamClient
from tailserve.bench.config import BenchConfig
from tailserve.bench.datasets import DatasetOptions
from tailserve.bench.http11 import LeanStreamClient
from tailserve.bench.run import run_bench
from tailserve.cli import main
from test_bench import DONE, USAGE, FakeServer, _console, chat_chunk, cmpl_chunk, event, sse

Answer = Callable[[int, asyncio.StreamWriter], Awaitable[bool]]


class RawServer:
    """A byte-exact HTTP/1.1 server in its own thread: ``answer(i, writer)`` writes the i-th
    request's response however the test wants and returns whether to keep the connection."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.requests: list[bytes] = []
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                self.requests.append(head + await reader.readexactly(length))
                if not await self.answer(len(self.requests) - 1, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._started.set()
        self.loop.run_forever()
        server.close()

    def __enter__(self) -> RawServer:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        async def stop() -> None:
            # Handlers still waiting (an idle keep-alive connection, a stalled answer) end
            # here, while the loop still runs, not as "Task was destroyed" at exit.
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self.loop)
        self._thread.join(10)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def send_all(make: Callable[[aiohttp.ClientSession], BenchClient], n: int = 1
             ) -> list[RequestResult]:
    """``n`` requests one after another through one client (so connections can be reused)."""

    async def go() -> list[RequestResult]:
        async with aiohttp.ClientSession() as session:
            client = make(session)
            out = []
            for i in range(n):
                res = RequestResult(i, f"rid-{i}", 5, 3, 0.0)
                await client.send(client.prepare(b'{"prompt": "x"}', res), res, perf_counter())
                out.append(res)
            await client.close()
            return out

    return asyncio.run(go())


def both(url: str, n: int = 1, timeout: float | None = 5.0
         ) -> tuple[list[RequestResult], list[RequestResult]]:
    """The same requests through the lean client, then through aiohttp."""
    lean = send_all(lambda _: LeanStreamClient(url, {}, timeout), n)
    aio = send_all(lambda session: StreamClient(session, url, {}, timeout), n)
    return lean, aio


def outcome(r: RequestResult) -> tuple[Any, ...]:
    return (r.success, r.status, r.error_type, r.text, r.output_tokens, r.finish_reason,
            r.server_timing, r.server_prompt_tokens)


# ---------------------------------------------------------------- single requests
def test_streaming_chunked_timing_matches_aiohttp() -> None:
    script = sse([chat_chunk("", role=True), b": ping\n\n", 0.15, chat_chunk("Hel"), 0.1,
                  chat_chunk("lo"), 0.05, chat_chunk("!", "length"), USAGE, DONE])
    with FakeServer({("POST", "/x"): script}) as srv:
        [lean], [aio] = both(srv.url + "/x")
    assert outcome(lean) == outcome(aio)
    assert lean.success and (lean.text, lean.output_tokens) == ("Hello!", 3)
    assert lean.ttft_s is not None and lean.e2el_s is not None
    assert 0.14 <= lean.ttft_s < 0.3 and len(lean.itl_s) == len(aio.itl_s) == 2
    assert 0.07 <= lean.itl_s[0] < 0.2 and 0.03 <= lean.itl_s[1] < 0.15
    assert lean.e2el_s >= lean.ttft_s + sum(lean.itl_s)
    assert lean.send_s is not None and lean.end_s is not None and lean.end_s >= lean.e2el_s


@pytest.mark.parametrize("script, error_type", [
    ([cmpl_chunk("a"), event({"error": {"message": "boom", "type": "engine_error"}}), DONE],
     "engine_error"),
    ([DONE], "no_content"),
    ([cmpl_chunk("a")], "incomplete_stream"),
    ([b"data: {not json\n\n"], "bad_json"),
    ([event({"choices": ["not an object"]}), DONE], "bad_response"),
    ([cmpl_chunk("abc")[:9], 0.05, cmpl_chunk("abc")[9:],
      cmpl_chunk("d", "stop").replace(b"\n\n", b"\r\n\r\n"), DONE], None),
])
def test_stream_outcomes_match_aiohttp(script: list[bytes | float], error_type: str | None
                                       ) -> None:
    with FakeServer({("POST", "/x"): sse(script)}) as srv:
        [lean], [aio] = both(srv.url + "/x")
    assert outcome(lean) == outcome(aio)
    assert lean.error_type == error_type and lean.status == 200


def test_content_length_bodies_and_non_streaming_json() -> None:
    """An SSE body with Content-Length in two writes; a plain JSON completion (a server that
    ignores stream=true) is, as with aiohttp, a response without content chunks."""
    body = cmpl_chunk("ab") + cmpl_chunk("c", "length") + USAGE + DONE
    cut = len(cmpl_chunk("ab")) + 5  # the first event and a bit of the second
    plain = json.dumps({"choices": [{"text": "abc", "finish_reason": "length"}]}).encode()

    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        if i % 2 == 0:
            w.write(SSE_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body[:cut])
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(body[cut:])
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(plain), plain))
        await w.drain()
        return True

    with RawServer(answer) as srv:
        lean, aio = both(srv.url + "/v1/completions", n=2)
        assert srv.connections == 2  # one kept-alive connection per client
    for a, b in zip(lean, aio, strict=True):
        assert outcome(a) == outcome(b)
    assert lean[0].success and lean[0].text == "abc" and lean[0].output_tokens == 3
    assert lean[0].ttft_s is not None and lean[0].ttft_s < 0.04 <= lean[0].itl_s[0]
    assert (lean[1].status, lean[1].error_type) == (200, "no_content")


def test_error_bodies_match_aiohttp() -> None:
    async def rejected(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "queue is full (8 waiting)",
                                            "type": "rate_limit_exceeded"}}, status=429)

    async def crashed(request: web.Request) -> web.Response:
        return web.Response(text="Internal Server Error", status=500)

    async def detail(request: web.Request) -> web.StreamResponse:
        # FastAPI's shape, in a chunked error body that arrives in two reads (aiohttp's
        # read(n) used to return only the first)
        resp = web.StreamResponse(status=422)
        await resp.prepare(request)
        await resp.write(b'{"detail": "bad')
        await asyncio.sleep(0.02)
        await resp.write(b' field"}')
        await resp.write_eof()
        return resp

    with FakeServer({("POST", "/429"): rejected, ("POST", "/500"): crashed,
                     ("POST", "/422"): detail}) as srv:
        for path, status, etype, msg in [
            ("/429", 429, "rate_limit_exceeded", "HTTP 429: queue is full (8 waiting)"),
            ("/500", 500, "http_500", "HTTP 500: Internal Server Error"),
            ("/422", 422, "http_422", "HTTP 422: bad field"),
        ]:
            [lean], [aio] = both(srv.url + path)
            assert (lean.status, lean.error_type, lean.error) == (status, etype, msg)
            assert (aio.status, aio.error_type, aio.error) == (status, etype, msg)


def test_connection_refused() -> None:
    [lean], [aio] = both(f"http://127.0.0.1:{free_port()}/x")
    for r in (lean, aio):
        assert (r.status, r.error_type, r.success) == (None, "connection_refused", False)
        assert r.send_s is not None and r.end_s is not None


@pytest.mark.parametrize("how, error_type", [
    ("close_before_head", "server_disconnected"),
    ("close_mid_chunked", "incomplete_response"),
    ("close_mid_length", "incomplete_response"),
    ("reset_mid_chunked", "incomplete_response"),
])
def test_server_closes_mid_response(how: str, error_type: str) -> None:
    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        if how == "close_before_head":
            w.write(b"HTTP/1.1 200 OK\r\nContent-")
        elif how == "close_mid_length":
            w.write(SSE_HEAD + b"Content-Length: 500\r\n\r\n" + cmpl_chunk("a"))
        else:
            w.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunk(cmpl_chunk("a")))
        await w.drain()
        await asyncio.sleep(0.05)
        if how.startswith("reset"):  # RST instead of FIN
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
        return False

    with RawServer(answer) as srv:
        [lean], [aio] = both(srv.url + "/x")
    assert lean.error_type == aio.error_type == error_type
    assert lean.status == aio.status == (None if how == "close_before_head" else 200)
    assert not lean.success and lean.end_s is not None


def test_keep_alive_reuse_and_connection_close() -> None:
    body = chunk(cmpl_chunk("a", "length") + DONE) + b"0\r\n\r\n"

    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        close = i >= 3
        w.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n"
                + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body)
        await w.drain()
        return not close

    with RawServer(answer) as srv:
        results = send_all(lambda _: LeanStreamClient(
            srv.url + "/x", {"Authorization": "Bearer k"}, 5.0), n=6)
        # Requests 0-3 on the first connection (kept alive; the 4th answer says close), then
        # a new connection for each of the last two.
        assert srv.connections == 3
        first = srv.requests[0]
    assert all(r.success and r.text == "a" for r in results)
    assert first.startswith(b"POST /x HTTP/1.1\r\n")
    assert b"\r\nx-request-id: rid-0\r\n" in first and b"\r\nAuthorization: Bearer k\r\n" in first
    assert first.endswith(b'\r\n\r\n{"prompt": "x"}') and b"Content-Length: 15\r\n" in first


def test_a_server_that_closes_after_each_response_loses_no_request() -> None:
    # llama-server: its head says keep-alive, then it closes once the stream ends. The next
    # request, already written to that connection, is sent once more on a new one.
    body = chunk(cmpl_chunk("a", "length") + DONE) + b"0\r\n\r\n"

    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5\r\n\r\n"
                + body)
        await w.drain()
        return False

    with RawServer(answer) as srv:
        results = send_all(lambda _: LeanStreamClient(srv.url + "/x", {}, 5.0), n=6)
        assert len(srv.requests) == 6 and srv.connections == 6  # each answered once
    assert all(r.success and r.text == "a" and r.send_s is not None for r in results)


def test_a_reused_connection_that_answered_something_is_not_retried() -> None:
    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        if i == 0:
            w.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                    + chunk(cmpl_chunk("a", "length") + DONE) + b"0\r\n\r\n")
            await w.drain()
            return True
        w.write(b"HTTP/1.1 200 OK\r\nContent-")  # then the connection closes
        await w.drain()
        return False

    with RawServer(answer) as srv:
        first, second = send_all(lambda _: LeanStreamClient(srv.url + "/x", {}, 5.0), n=2)
        assert len(srv.requests) == 2  # the second was read, half answered: not sent again
    assert first.success and second.error_type == "server_disconnected"


def test_timeout_matches_aiohttp() -> None:
    with FakeServer({("POST", "/x"): sse([cmpl_chunk("a"), 1.0, DONE])}) as srv:
        [lean], [aio] = both(srv.url + "/x", timeout=0.3)
    for r in (lean, aio):
        assert r.error_type == "timeout" and "--timeout 0.3" in (r.error or "")
        assert r.end_s is not None and r.send_s is not None and r.end_s - r.send_s < 0.9


# ---------------------------------------------------------------- whole runs
async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "other"}]})


async def _every_fourth_rejected(request: web.Request) -> web.StreamResponse:
    """Request i of a step is rejected with 429 when i % 4 == 0, by its x-request-id, so the
    same requests fail whatever order they arrive in; the others stream two tokens."""
    index = request.headers["x-request-id"].rsplit("-", 1)[1]
    if index.isdigit() and int(index) % 4 == 0:
        return web.json_response({"error": {"message": "full", "type": "rate_limit"}},
                                 status=429)
    return await sse([cmpl_chunk("a"), cmpl_chunk("b", "length"), USAGE, DONE])(request)


def test_runs_agree_between_clients() -> None:
    """The same responder, the same run with each client: the same counts and failures
    (request i of the step is rejected with 429 when i % 4 == 0, by its x-request-id, so the
    same requests fail whatever order they arrive in)."""

    out = {}
    with FakeServer({("GET", "/v1/models"): _models,
                     ("POST", "/v1/completions"): _every_fourth_rejected}) as srv:
        for kind in ("lean", "aiohttp"):
            cfg = BenchConfig(base_url=srv.url, http_client=kind, request_rate=200.0,
                              progress=False, observe=False,
                              dataset=DatasetOptions(num_prompts=15, input_len=8, output_len=3))
            [out[kind]] = run_bench(cfg, _console()[0])
    lean, aio = out["lean"], out["aiohttp"]
    assert lean["tailserve"]["environment"]["http_client"] == "lean"
    assert aio["tailserve"]["environment"]["http_client"] == "aiohttp"
    for key in ("completed", "failed", "total_output_tokens", "total_input_tokens"):
        assert lean[key] == aio[key], key
    assert (lean["completed"], lean["failed"]) == (11, 4)  # 0, 4, 8, 12
    assert lean["tailserve"]["failures"] == aio["tailserve"]["failures"]
    assert lean["tailserve"]["failures"]["by_type"] == {"rate_limit": 4}


def test_tokenizer_path_end_to_end(tiny_model_dir: str, tmp_path: Path) -> None:
    """--tokenizer PATH: prompt lengths from the local tokenizer (exact), and a server that
    sends no usage gets its output counted with it."""
    stream = sse([cmpl_chunk("hello"), cmpl_chunk(" world", "length"), DONE])
    path = tmp_path / "r.json"
    with FakeServer({("GET", "/v1/models"): _models,
                     ("POST", "/v1/completions"): stream}) as srv:
        rc = main(["bench", "--base-url", srv.url, "--num-prompts", "4", "--input-len", "12",
                   "--output-len", "2", "--tokenizer", tiny_model_dir, "--no-progress",
                   "--save-result", str(path)])
    assert rc == 0
    r = json.loads(path.read_text())
    ts = r["tailserve"]
    assert ts["tokenizer"] == {"source": ts["tokenizer"]["source"], "exact": True}
    assert tiny_model_dir in ts["tokenizer"]["source"]
    assert {q["prompt_len"] for q in ts["requests"]} == {12}
    assert {q["output_tokens_source"] for q in ts["requests"]} == {"tokenizer"}
    from tailserve.model.loader import load_tokenizer

    n = len(load_tokenizer(tiny_model_dir).encode("hello world", add_special_tokens=False))
    assert r["total_output_tokens"] == 4 * n


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is "
                        "available to make a self-signed certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                        "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        return cert, key
    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
         .public_key(pkey.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=1))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName(
             [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
         .sign(pkey, hashes.SHA256()))
    Path(cert).write_bytes(c.public_bytes(serialization.Encoding.PEM))
    Path(key).write_bytes(pkey.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    return cert, key


def test_https_run_through_aiohttp(tmp_path: Path) -> None:
    """https:// goes through aiohttp (the lean client speaks plain http) and verifies the
    server's certificate: trusted via SSL_CERT_FILE, in a child process because aiohttp
    builds its default TLS context once, at import."""
    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    stream = sse([cmpl_chunk("a"), cmpl_chunk("b", "length"), USAGE, DONE])
    path = tmp_path / "r.json"
    with FakeServer({("GET", "/v1/models"): _models,
                     ("POST", "/v1/completions"): stream}, ssl_context=ctx) as srv:
        assert srv.url.startswith("https://")
        cmd = [sys.executable, "-m", "tailserve.cli", "bench", "--base-url", srv.url,
               "--num-prompts", "3", "--input-len", "8", "--no-progress",
               "--save-result", str(path)]
        env = {"SSL_CERT_FILE": cert, "PATH": "/usr/bin:/bin", "OMP_WAIT_POLICY": "PASSIVE"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        untrusted = subprocess.run(cmd, env={**env, "SSL_CERT_FILE": "/nonexistent"},
                                   capture_output=True, text=True, timeout=120)
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (3, 0, 9)
    assert r["tailserve"]["environment"]["http_client"] == "aiohttp"
    assert untrusted.returncode == 2 and "certificate" in untrusted.stderr.lower()


# ---------------------------------------------------------------- --busy-poll
def _open_loop_run(clients: list[BenchClient], n: int, gap_s: float, busy_poll: bool
                   ) -> tuple[list[RequestResult], float, float]:
    """``n`` requests ``gap_s`` apart through the bench's open loop (client i % len(clients));
    the results, the wall time and this thread's CPU time over the run."""
    from tailserve.bench.open_loop import open_loop
    from tailserve.bench.report import Progress

    results = [RequestResult(i, f"rid-{i}", 5, 3, i * gap_s) for i in range(n)]
    use = [clients[i % len(clients)] for i in range(n)]
    payloads = [c.prepare(b'{"prompt": "x"}', r) for c, r in zip(use, results, strict=True)]

    async def go() -> tuple[float, float]:
        wall, cpu = perf_counter(), time.thread_time()
        with Progress(_console()[0], n, "t", False) as progress:
            await open_loop(use, payloads, results, None, perf_counter(), progress, busy_poll)
        for c in clients:
            await c.close()  # type: ignore[attr-defined]
        return perf_counter() - wall, time.thread_time() - cpu

    wall, cpu = asyncio.run(go())
    return results, wall, cpu


def test_busy_poll_same_outcomes_as_waiting() -> None:
    """The same real responder, the same schedule, with and without busy polling: the same
    texts, token counts, timings from the server and failures — a timeout (the responder
    stalls after the first chunk for requests 3k+1) and a refused connection (3k+2)."""
    body = (chunk(cmpl_chunk("a") + cmpl_chunk("b", "length") + USAGE + DONE)
            + b"0\r\n\r\n")

    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        rid = int(srv.requests[i].split(b"x-request-id: rid-", 1)[1].split(b"\r\n", 1)[0])
        w.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        if rid % 3 == 1:
            w.write(chunk(cmpl_chunk("a")))
            await w.drain()
            await asyncio.sleep(1.0)  # past the client's 0.2 s timeout: it drops the connection
            return False
        w.write(body)
        await w.drain()
        return True

    refused = f"http://127.0.0.1:{free_port()}/x"
    out = {}
    with RawServer(answer) as srv:
        for busy in (False, True):
            clients: list[BenchClient] = [LeanStreamClient(srv.url + "/x", {}, 0.2),
                                          LeanStreamClient(srv.url + "/x", {}, 0.2),
                                          LeanStreamClient(refused, {}, 0.2)]
            out[busy], _, _ = _open_loop_run(clients, 9, 0.02, busy)
    for waiting, busy_r in zip(out[False], out[True], strict=True):
        assert outcome(waiting) == outcome(busy_r)
        assert busy_r.send_s is not None and busy_r.end_s is not None
    kinds = [r.error_type for r in out[True]]
    assert kinds == [None, "timeout", "connection_refused"] * 3
    ok = out[True][0]
    assert ok.success and ok.text == "ab" and ok.output_tokens == 3 and ok.ttft_s is not None
    assert ok.server_timing == {"queue_s": 0.001}


def test_busy_poll_spins_only_while_something_is_in_flight_or_due() -> None:
    """One slow response (0.3 s) in flight: the busy loop spins through it. Two quick
    responses 0.3 s apart: it sleeps between them. Six slow ones at once (above
    BUSY_POLL_MAX_IN_FLIGHT): it waits in epoll as without the option."""

    async def answer(i: int, w: asyncio.StreamWriter) -> bool:
        if slow:
            await asyncio.sleep(0.3)
        w.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                + chunk(cmpl_chunk("a", "length") + DONE) + b"0\r\n\r\n")
        await w.drain()
        return True

    with RawServer(answer) as srv:
        url = srv.url + "/x"
        slow = True
        res, wall, spun = _open_loop_run([LeanStreamClient(url, {}, 5.0)], 1, 0.0, True)
        assert res[0].success and wall >= 0.3
        res, wall, waited = _open_loop_run([LeanStreamClient(url, {}, 5.0)], 1, 0.0, False)
        assert res[0].success and waited < 0.03
        # ~0.3 s of CPU when the core is free; a spinner yields to every waiting task, so on
        # a loaded host it gets less, but still far more than waiting in epoll.
        assert spun > 0.05
        slow = False
        res, wall, cpu = _open_loop_run([LeanStreamClient(url, {}, 5.0)], 2, 0.3, True)
        assert all(r.success for r in res) and wall >= 0.3 and cpu < 0.1
        slow = True
        res, wall, cpu = _open_loop_run([LeanStreamClient(url, {}, 5.0) for _ in range(6)],
                                        6, 0.0, True)
        assert all(r.success for r in res) and cpu < 0.1


def test_busy_poll_run_matches_and_is_recorded() -> None:
    """Whole runs through run_bench with and without --busy-poll: the same counts and
    failures, and the result says which ran."""

    out = {}
    with FakeServer({("GET", "/v1/models"): _models,
                     ("POST", "/v1/completions"): _every_fourth_rejected}) as srv:
        for busy in (False, True):
            cfg = BenchConfig(base_url=srv.url, busy_poll=busy, request_rate=200.0,
                              progress=False, observe=False,
                              dataset=DatasetOptions(num_prompts=12, input_len=8, output_len=3))
            [out[busy]] = run_bench(cfg, _console()[0])
    assert out[True]["tailserve"]["environment"]["busy_poll"] is True
    assert out[False]["tailserve"]["environment"]["busy_poll"] is False
    for key in ("completed", "failed", "total_output_tokens", "total_input_tokens"):
        assert out[True][key] == out[False][key], key
    assert out[True]["tailserve"]["failures"] == out[False]["tailserve"]["failures"]
    assert (out[True]["completed"], out[True]["failed"]) == (9, 3)
