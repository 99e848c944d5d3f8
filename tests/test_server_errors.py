"""Live-server tests for the failure behaviour users rely on (issue 3, items 6 and 7): every
error is an OpenAI-style body with the right status, ``param`` and numbers, no leak of
internals; the API key guards every route but /health and /metrics, whatever the path or Host
says; and schemathesis finds no 5xx anywhere in the published OpenAPI schema.

Real ``tailserve serve`` processes on loopback (tiny random model), httpx and raw sockets.
429 and 503 belong to the lifecycle tests.
"""

from __future__ import annotations

import copy
import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from server_util import ServerProcess, metric_value

MAX_REQUEST_BYTES = 20000
# n x (prompt + max_tokens) per request: four sequences of the tiny model's 512 tokens.
MAX_REQUEST_TOKENS = 2048
API_KEY = "sekret"
# Set to "" so a TAILSERVE_API_KEY in the developer's shell cannot turn auth on where a test
# expects it off (the CLI treats an empty value as unset).
NO_KEY_ENV = {"TAILSERVE_API_KEY": ""}


# ------------------------------------------------------------------------------ helpers
def assert_openai_error(
    r: httpx.Response, status: int, param: str | None = None, numbers: tuple[Any, ...] = ()
) -> dict[str, Any]:
    """``r`` is ``status`` with ``{"error": {"message", "type", "param", "code"}}``; ``param``
    (when given) is named; every one of ``numbers`` appears in the message; no internals leak."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    return check_error_body(r.text, param, numbers)


def check_error_body(
    text: str, param: str | None = None, numbers: tuple[Any, ...] = ()
) -> dict[str, Any]:
    body = json.loads(text)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    for n in numbers:
        assert re.search(rf"(?<![\d.]){re.escape(str(n))}(?![\d.])", err["message"]), (n, err)
    assert_no_internals(text)
    return dict(err)


def assert_no_internals(text: str) -> None:
    for leak in ("Traceback", "/work", ".py", "0x", 'File "'):
        assert leak not in text, (leak, text)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def raw_http(port: int, head: bytes, body: bytes = b"", send_chunks: list[bytes] | None = None
             ) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` (request line and headers, without the blank line) exactly as given, then
    ``body``; read to EOF (``Connection: close`` is added). Returns status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"\r\nConnection: close\r\n\r\n" + body)
        try:
            for chunk in send_chunks or []:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (413) and closed while we were still sending
        data = read_until_closed(s)
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        payload = payload[: int(headers["content-length"])]
    return status, headers, payload


# ------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def err_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    """Default max_model_len (512, the tiny model's) and a small body limit; no API key."""
    with ServerProcess(["--max-request-bytes", str(MAX_REQUEST_BYTES),
                        "--max-request-tokens", str(MAX_REQUEST_TOKENS)],
                       model=tiny_model_dir, env=NO_KEY_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(err_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=err_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def auth_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(["--api-key", API_KEY], model=tiny_model_dir, env=NO_KEY_ENV) as srv:
        yield srv


def _chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


# ------------------------------------------------------------------------------ 400s
def test_malformed_json_is_400(client: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        for raw in (b'{"prompt": "hi",', b"not json", b'{"prompt": "hi"}}'):
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            err = assert_openai_error(r, 400)
            assert err["type"] == "invalid_request_error"
            assert err["code"] == "invalid_json", err


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 1.5}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", _chat(logprobs="yes please"), "logprobs"),
    ("/v1/chat/completions", _chat(stream=[]), "stream"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
])
def test_wrong_types_are_400_with_param(
    client: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert_openai_error(client.post(path, json=body), 400, param)


def test_missing_required_field_is_400(client: httpx.Client) -> None:
    assert_openai_error(client.post("/v1/completions", json={"max_tokens": 2}), 400, "prompt")
    assert_openai_error(client.post("/v1/chat/completions", json={}), 400, "messages")


def test_prompt_longer_than_max_model_len(client: httpx.Client) -> None:
    # Token ids: exactly 600 prompt tokens, the message must say 600 and 512.
    r = client.post("/v1/completions", json={"prompt": list(range(100, 700)), "max_tokens": 1})
    assert_openai_error(r, 400, "input_tokens", (600, 512))
    # Text: whatever it tokenizes to, both numbers are in the message.
    text = "hello " * 600
    n = client.post("/tokenize", json={"prompt": text}).json()["count"]
    assert n > 512
    r = client.post("/v1/completions", json={"prompt": text})
    assert_openai_error(r, 400, "input_tokens", (n, 512))
    # Chat: the templated conversation is what counts.
    r = client.post("/v1/chat/completions", json=_chat("hello " * 600))
    assert_openai_error(r, 400, "input_tokens", (512,))
    # Exactly max_model_len tokens leave no room for an output token.
    r = client.post("/v1/completions", json={"prompt": [5] * 512, "max_tokens": 1})
    assert_openai_error(r, 400, "input_tokens", (512,))


def test_prompt_plus_max_tokens_too_large(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 503})
    assert_openai_error(r, 400, "max_tokens", (10, 503, 513, 512))
    r = client.post("/v1/chat/completions", json=_chat(max_completion_tokens=100000))
    assert_openai_error(r, 400, "max_tokens", (100000, 512))
    # The boundary itself is allowed: 500 + 12 == 512.
    r = client.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 12})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 500


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}),
    ("/v1/chat/completions", _chat(max_tokens=0)),
    ("/v1/chat/completions", _chat(max_completion_tokens=0)),
])
def test_max_tokens_below_one(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    param = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
    assert_openai_error(client.post(path, json=body), 400, param, (body[param],))


@pytest.mark.parametrize(("path", "body", "param", "numbers"), [
    ("/v1/completions", {"prompt": "hi", "n": 17, "max_tokens": 1}, "n", (16, 17)),
    ("/v1/chat/completions", _chat(n=17, max_tokens=1), "n", (16, 17)),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", (0, 16)),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21, "max_tokens": 1}, "logprobs", (20, 21)),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs", (20, -1)),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21, max_tokens=1),
     "top_logprobs", (20, 21)),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=-1), "top_logprobs", (20, -1)),
])
def test_caps_on_n_and_logprobs(
    client: httpx.Client, path: str, body: dict[str, Any], param: str, numbers: tuple[int, ...]
) -> None:
    assert_openai_error(client.post(path, json=body), 400, param, numbers)


@pytest.mark.parametrize(("field", "value", "numbers"), [
    # Beyond 64 bits: these used to reach the msgpack encoder and come back 500.
    ("seed", 2**64, (2**63 - 1,)),
    ("seed", -(2**63) - 1, ()),
    ("top_k", 2**70, (2**63 - 1,)),
    ("priority", 2**70, (2**63 - 1,)),
    ("stop_token_ids", [2**70], (2**63 - 1,)),
    # Non-finite floats (Python's json and pydantic accept NaN / Infinity): these used to be
    # sampled with, picking token 0 every step.
    ("temperature", float("nan"), ()),
    ("temperature", float("inf"), ()),
    ("repetition_penalty", float("nan"), ()),
    ("top_p", float("nan"), ()),
])
def test_out_of_range_numbers_are_400(
    client: httpx.Client, field: str, value: Any, numbers: tuple[int, ...]
) -> None:
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    r = client.post("/v1/completions", content=json.dumps(body),
                    headers={"content-type": "application/json"})
    assert_openai_error(r, 400, field, numbers)


@pytest.mark.parametrize("extra", [
    {"top_p": 5e-324},  # rounds to 0 in float32: used to keep no token and kill the engine
    {"top_p": 1e-46, "top_k": 3},
    {"top_k": 2**62, "top_p": 0.5},
    {"min_p": 1.0, "top_k": 1},
    {"temperature": 1e300},
    {"seed": -(2**63)},
    {"seed": 2**63 - 1},
    {"priority": -(2**63)},
    {"stop_token_ids": [0]},
    {"top_k": -1},
    {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1e300},
    {"n": 16, "logprobs": 20, "stream": True},
])
def test_extreme_valid_values_are_served(client: httpx.Client, extra: dict[str, Any]) -> None:
    """In range, however odd: answered 200, and the engine lives on."""
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **extra})
    assert r.status_code == 200, r.text
    if not extra.get("stream"):
        assert r.json()["usage"]["completion_tokens"] >= 1
    else:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        assert '"error"' not in r.text
    assert client.get("/health").status_code == 200


def test_tiny_temperature_samples_greedily(client: httpx.Client) -> None:
    """logits / 1e-300 overflow; such a temperature means greedy, not NaN probabilities."""
    def tokens(temperature: float) -> list[str]:
        r = client.post("/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True,
            "temperature": temperature, "logprobs": 0,
        })
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["logprobs"]["tokens"])

    assert tokens(1e-300) == tokens(0.0)


def test_token_ids_out_of_vocabulary(client: httpx.Client) -> None:
    for prompt, bad in (([1, 2, 10**9], 10**9), ([[1, -5]], -5), ([1, 2**80], 2**80)):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        err = assert_openai_error(r, 400, "prompt", (bad,))
        assert re.search(r"\[0, \d+\)", err["message"]), err  # states the valid range
    r = client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert_openai_error(r, 400, "tokens", (10**9,))


def test_stop_token_ids_outside_the_vocabulary(client: httpx.Client) -> None:
    for bad in (10**9, -1, 2**63 - 1):
        r = client.post("/v1/completions",
                        json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": [1, bad]})
        err = assert_openai_error(r, 400, "stop_token_ids", (bad,))
        assert re.search(r"\[0, \d+\)", err["message"]), err


@pytest.mark.parametrize(("body", "param", "numbers"), [
    ({"top_k": -2}, "top_k", (-2,)),
    ({"top_k": -(2**63)}, "top_k", (-(2**63),)),
    ({"seed": 2**63 - 1, "n": 3}, "seed", (2**63 - 3, 3)),
    ({"presence_penalty": -2.5}, "presence_penalty", (-2.5,)),
    ({"frequency_penalty": 3.0}, "frequency_penalty", (3.0,)),
    ({"repetition_penalty": -1.0}, "repetition_penalty", (-1.0,)),
])
def test_sampling_fields_outside_their_ranges(
    client: httpx.Client, body: dict[str, Any], param: str, numbers: tuple[Any, ...]
) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert_openai_error(r, 400, param, numbers)


def test_n_times_max_tokens_beyond_the_request_cap(client: httpx.Client) -> None:
    """n=16 x (10 + 200) = 3360 tokens > the cap of 2048: refused before anything runs."""
    r = client.post("/v1/completions",
                    json={"prompt": [5] * 10, "n": 16, "max_tokens": 200})
    assert_openai_error(r, 400, "n", (16, 10, 200, 3360, MAX_REQUEST_TOKENS))
    r = client.post("/v1/chat/completions", json=_chat(n=16, max_tokens=200))
    assert_openai_error(r, 400, "n", (16, 200, MAX_REQUEST_TOKENS))
    # The boundary is allowed: 4 x (12 + 500) = 2048.
    r = client.post("/v1/completions", json={"prompt": [5] * 12, "n": 4, "max_tokens": 500,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2000


def test_null_max_tokens_runs_to_max_model_len_under_the_cap(client: httpx.Client) -> None:
    # One sequence: 512 - 10 = 502 tokens (vLLM's reading of null, the cap not binding).
    r = client.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": None,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 502
    # Eight sequences share 2048 tokens: 2048 // 8 - 10 = 246 each.
    r = client.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": None, "n": 8,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 * 246
    assert {c["finish_reason"] for c in r.json()["choices"]} == {"length"}


def test_empty_prompts_are_400(client: httpx.Client) -> None:
    for prompt in ("", [], [[]], [""]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert_openai_error(r, 400, "prompt")


# ------------------------------------------------------------------------------ 404s
def test_unknown_model_is_404(client: httpx.Client, model_name: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4o", "max_tokens": 2}),
        ("/v1/chat/completions", _chat(model="gpt-4o", max_tokens=2)),
        ("/tokenize", {"prompt": "hi", "model": "gpt-4o"}),
    ):
        err = assert_openai_error(client.post(path, json=body), 404, "model")
        assert err["code"] == "model_not_found", err
        assert "gpt-4o" in err["message"] and model_name in err["message"], err
    # The served name works.
    r = client.post("/v1/completions", json={"prompt": "hi", "model": model_name,
                                             "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert_openai_error(client.get("/v1/nope"), 404)
    assert_openai_error(client.get("/v1/completions"), 405)


# ------------------------------------------------------------------------------ 413 / 431
def test_body_over_limit_with_content_length_is_413(err_server: ServerProcess) -> None:
    body = json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES + 100), "max_tokens": 2}).encode()
    r = httpx.post(err_server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    err = assert_openai_error(r, 413, numbers=(len(body), MAX_REQUEST_BYTES))
    assert err["code"] == "request_too_large", err
    # Just under the limit is read and judged on its merits (far too many tokens here).
    body = json.dumps({"prompt": "hello " * 3000, "max_tokens": 2}).encode()
    assert len(body) < MAX_REQUEST_BYTES
    r = httpx.post(err_server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, 400, "input_tokens")


def test_chunked_body_over_limit_is_413(err_server: ServerProcess) -> None:
    # httpx: a generator body goes out chunked, without Content-Length.
    def parts() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 1000
        yield b'", "max_tokens": 2}'

    r = httpx.post(err_server.url + "/v1/completions", content=parts(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in r.request.headers
    assert r.request.headers["transfer-encoding"] == "chunked"
    err = assert_openai_error(r, 413, numbers=(MAX_REQUEST_BYTES,))
    assert err["code"] == "request_too_large", err

    # Raw socket: chunked, and the client keeps sending well past the limit.
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked")
    chunk = b"y" * 4096
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    status, _, payload = raw_http(
        err_server.port, head, b'c\r\n{"messages":\r\n', send_chunks=[framed] * 40
    )
    assert status == 413, payload
    check_error_body(payload.decode(), numbers=(MAX_REQUEST_BYTES,))


def test_oversized_headers_are_431(err_server: ServerProcess) -> None:
    r = httpx.get(err_server.url + "/v1/models", headers={"x-big": "a" * 40000}, timeout=30)
    err = assert_openai_error(r, 431)
    assert err["code"] == "headers_too_large", err
    assert str(16 << 10) in err["message"], err  # the default limit
    # Many small headers add up the same way; raw socket so nothing is folded or dropped.
    many = b"".join(b"\r\nX-H%d: %s" % (i, b"b" * 100) for i in range(400))
    status, _, payload = raw_http(err_server.port, b"GET /health HTTP/1.1\r\nHost: x" + many)
    assert status == 431
    check_error_body(payload.decode())


# ------------------------------------------------------------------------------ lone surrogates
# Valid JSON, no valid Unicode: "\ud800" decodes to a lone surrogate, which the tokenizer and
# msgpack refuse (a TypeError, a 500). json.dumps writes it as the escape, as a client would.
SURROGATE_CASES = [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2},
     "prompt contains a lone surrogate (U+D800) at index 0", "prompt"),
    ("/v1/completions", {"prompt": ["fine", "bad \udbff"], "max_tokens": 2},
     "prompt[1] contains a lone surrogate (U+DBFF) at index 4", "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["\udfff"]},
     "stop[0] contains a lone surrogate (U+DFFF) at index 0", "stop"),
    ("/v1/chat/completions", _chat("x\ud800", max_tokens=2),
     "messages[0].content contains a lone surrogate (U+D800) at index 1", "messages"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages[0].content[0].text contains a lone surrogate (U+DC00) at index 0", "messages"),
    ("/v1/chat/completions", _chat(stop="ab\ud800"),
     "stop[0] contains a lone surrogate (U+D800) at index 2", "stop"),
    ("/tokenize", {"prompt": "\ud800"},
     "prompt contains a lone surrogate (U+D800) at index 0", "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]},
     "messages[0].content contains a lone surrogate (U+DFFF) at index 0", "messages"),
]


@pytest.mark.parametrize(("path", "body", "fragment", "param"), SURROGATE_CASES)
def test_a_lone_surrogate_is_400_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any], fragment: str, param: str
) -> None:
    raw = json.dumps(body)
    assert "\\ud" in raw  # sent as the JSON escape
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400, param)
    assert err["type"] == "invalid_request_error"
    assert err["message"] == f"{fragment}; text must be valid Unicode", err


def test_a_surrogate_pair_is_served(client: httpx.Client) -> None:
    # "\ud83d\ude00" is one code point (U+1F600), valid text.
    raw = json.dumps({"prompt": "smile \U0001F600", "max_tokens": 2, "ignore_eos": True})
    assert "\\ud83d\\ude00" in raw
    r = client.post("/v1/completions", content=raw,
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------ afterwards
def test_server_healthy_after_the_errors(
    client: httpx.Client, err_server: ServerProcess
) -> None:
    """Runs last in this group: none of the rejected requests hurt the server."""
    assert client.post("/v1/completions", json={"prompt": "hi", "n": 99}).status_code == 400
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    r = client.post("/v1/chat/completions", json=_chat(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    metrics = client.get("/metrics").text
    assert metric_value(metrics, "tailserve:num_requests_running") == 0
    assert metric_value(metrics, "tailserve:num_requests_waiting") == 0
    rejected = metric_value(metrics, "tailserve:requests_rejected_total",
                            {"reason": "invalid_request"})
    assert rejected is not None and rejected > 0
    # Nothing above was an unhandled exception (those are logged with their traceback).
    assert "Traceback" not in err_server.output(), err_server.output()


# ------------------------------------------------------------------------------ auth
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", _chat(max_tokens=2)),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/version", None),
    ("GET", "/debug/timeline", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/no/such/path", None),
]
WRONG_AUTH = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": API_KEY},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": "Bearer"},
    {"X-API-Key": API_KEY},
]


def _assert_401(r: httpx.Response) -> None:
    err = assert_openai_error(r, 401)
    assert err["type"] == "authentication_error", err
    assert r.headers.get("www-authenticate", "").lower().startswith("bearer"), r.headers
    assert API_KEY not in r.text


def test_auth_exempt_routes(auth_server: ServerProcess) -> None:
    for headers in WRONG_AUTH[:2]:
        r = httpx.get(auth_server.url + "/health", headers=headers, timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = httpx.get(auth_server.url + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 200 and "tailserve:num_requests_running" in r.text


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_auth_required(
    auth_server: ServerProcess, method: str, path: str, body: dict[str, Any] | None
) -> None:
    url = auth_server.url + path
    for headers in WRONG_AUTH:
        _assert_401(httpx.request(method, url, json=body, headers=headers, timeout=30))
    for scheme in ("Bearer", "bearer"):
        r = httpx.request(method, url, json=body, timeout=30,
                          headers={"Authorization": f"{scheme} {API_KEY}"})
        if path == "/no/such/path":
            assert_openai_error(r, 404)
        else:
            assert r.status_code == 200, (path, r.text)
    if path == "/v1/models":
        assert r.json()["data"][0]["object"] == "model"
    if path == "/v1/completions":
        assert r.json()["usage"]["completion_tokens"] >= 1
    if path == "/docs":
        assert "swagger" in r.text.lower()


def test_openai_client_with_and_without_key(auth_server: ServerProcess) -> None:
    import openai

    good = openai.OpenAI(base_url=auth_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].object == "model"
    bad = openai.OpenAI(base_url=auth_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401


@pytest.mark.parametrize("target", [
    b"/health/../v1/models",
    b"//v1/models",
    b"/v1/models?/health",
    b"/v1/models#/health",
    b"/%68ealth/../v1/models",
    b"/health%2F..%2Fv1%2Fmodels",
    b"/health/%2e%2e/v1/models",
    b"/health;/../v1/models",
    b"/metrics/../v1/models",
    b"/./v1/models",
    b"/v1//models",
    b"/v1/./models",
    b"/HEALTH",
    b"/health/",
    b"ABSOLUTE/v1/models",
    b"ABSOLUTE/health/../v1/models",
])
def test_no_path_trick_bypasses_auth(auth_server: ServerProcess, target: bytes) -> None:
    port = auth_server.port
    target = target.replace(b"ABSOLUTE", b"http://127.0.0.1:%d" % port)
    status, _, payload = raw_http(port, b"GET %s HTTP/1.1\r\nHost: 127.0.0.1:%d" % (target, port))
    assert status != 200, (target, payload)
    assert b'"data"' not in payload and b'"object":"list"' not in payload, payload
    assert status in (400, 401, 404), (status, payload)
    if status == 401:
        check_error_body(payload.decode())


@pytest.mark.parametrize("extra", [
    b"Host: x/health",
    b"Host: 127.0.0.1/health?",
    b"Host: 127.0.0.1\r\nX-Original-URL: /health\r\nX-Rewrite-URL: /health",
    b"Host: 127.0.0.1\r\nX-Forwarded-Prefix: /health\r\nX-Forwarded-Path: /health",
])
def test_no_host_or_header_trick_bypasses_auth(auth_server: ServerProcess, extra: bytes) -> None:
    status, _, payload = raw_http(auth_server.port, b"GET /v1/models HTTP/1.1\r\n" + extra)
    assert status in (400, 401), (status, payload)
    assert b'"data"' not in payload, payload


def test_raw_request_with_key_gets_the_models(auth_server: ServerProcess) -> None:
    """The control for the trick tests: their request shape does reach the data with a key."""
    status, _, payload = raw_http(
        auth_server.port,
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode(),
    )
    assert status == 200
    assert b'"data"' in payload and b'"object":"list"' in payload


# ------------------------------------------------------------------------------ schemathesis
ENV_KEY = "from-env"
ENV_AUTH = {"Authorization": f"Bearer {ENV_KEY}"}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    """The key from TAILSERVE_API_KEY (not the flag); max_model_len 128 bounds every
    generation the fuzzer can ask for."""
    with ServerProcess(["--max-model-len", "128"], model=tiny_model_dir,
                       env={"TAILSERVE_API_KEY": ENV_KEY}) as srv:
        yield srv


def test_api_key_from_environment(fuzz_server: ServerProcess) -> None:
    url = fuzz_server.url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    _assert_401(httpx.get(url + "/v1/models", timeout=10))
    _assert_401(httpx.get(url + "/v1/models", timeout=10,
                          headers={"Authorization": f"Bearer {API_KEY}"}))
    r = httpx.get(url + "/v1/models", timeout=10, headers=ENV_AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "model"


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=ENV_AUTH)


def test_openapi_declares_the_400_the_server_answers(fuzz_server: ServerProcess) -> None:
    """Invalid requests get 400 with an OpenAI error body, and /openapi.json says so (FastAPI
    would declare 422 with its own validation body)."""
    raw = httpx.get(fuzz_server.url + "/openapi.json", headers=ENV_AUTH, timeout=10).json()
    assert "HTTPValidationError" not in raw["components"]["schemas"]
    with_body = 0
    for path, item in raw["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (method, path)
            if "requestBody" in operation:
                with_body += 1
                ref = operation["responses"]["400"]["content"]["application/json"]["schema"]
                assert ref == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
    assert with_body == 5  # completions, chat completions, responses, tokenize, detokenize
    r = httpx.post(fuzz_server.url + "/v1/completions", headers=ENV_AUTH, timeout=10,
                   json={"prompt": "hi", "max_tokens": "many"})
    assert r.status_code == 400
    error = raw["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(r.json()["error"]) == set(error["required"]) == set(error["properties"])


def served_ranges(schema: dict[str, Any], model: str, vocab_size: int) -> dict[str, Any]:
    """``schema`` with the ranges the server enforces (SamplingParams, the length check, the
    vocabulary) written into the completion and chat bodies, and the unsupported fields held
    off. The published schema leaves them out (the server checks them to word its messages),
    so its positive cases almost never get past validation; these do, and carry 64-bit seeds,
    priorities and stop ids, streaming and n > 1 into the engine."""
    schema = copy.deepcopy(schema)
    nullable = {"type": "null"}

    def integer(lo: int, hi: int) -> dict[str, Any]:
        return {"type": "integer", "minimum": lo, "maximum": hi}

    def number(lo: float, hi: float, exclusive_lo: bool = False) -> dict[str, Any]:
        low = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
        return {"type": "number", **low, "maximum": hi}

    ranges: dict[str, dict[str, Any]] = {
        "model": {"enum": [model, None]},
        "n": integer(1, 3),
        "max_tokens": integer(1, 12),
        "max_completion_tokens": integer(1, 12),
        "min_tokens": integer(0, 1),
        "temperature": number(0, 2),
        "top_p": number(0, 1, exclusive_lo=True),
        "min_p": number(0, 1),
        "top_k": integer(-1, 2**63 - 1),
        "presence_penalty": number(-2, 2),
        "frequency_penalty": number(-2, 2),
        "repetition_penalty": number(0, 2, exclusive_lo=True),
        "logprobs": integer(0, 20),  # the chat body's logprobs is a bool: left alone below
        "top_logprobs": integer(0, 20),
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 3},
        "prompt": {"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 100},
            {"type": "array", "minItems": 1, "maxItems": 40,
             "items": integer(0, vocab_size - 1)},
        ]},
        "echo": {"const": False}, "suffix": nullable, "best_of": nullable,
        "logit_bias": nullable, "tools": nullable, "tool_choice": nullable,
        # a random grammar is mostly a 400: served mode leaves structured output alone
        "response_format": nullable, "structured_outputs": nullable, "guided_json": nullable,
        "guided_regex": nullable, "guided_choice": nullable, "guided_grammar": nullable,
    }
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        for field, narrowed in ranges.items():
            if field in props and not (name == "ChatCompletionRequest" and field == "logprobs"):
                props[field] = {**narrowed, "default": props[field].get("default")}
    components["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 3
    message = components["ChatMessage"]["properties"]
    message["content"] = {"anyOf": [{"type": "string", "maxLength": 100}, nullable]}
    # Tool messages are checked in server/tools.py (tests/test_server_tools.py): a random
    # call or a tool message without its call's id is a 400.
    message["tool_calls"] = nullable
    message["tool_call_id"] = {"type": "string", "maxLength": 20}
    return schema


@pytest.fixture(scope="module")
def served_schema(fuzz_server: ServerProcess, tiny_model_dir: str) -> Any:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    models = httpx.get(fuzz_server.url + "/v1/models", headers=ENV_AUTH, timeout=10).json()
    raw = httpx.get(fuzz_server.url + "/openapi.json", headers=ENV_AUTH, timeout=10).json()
    return schemathesis.openapi.from_dict(
        served_ranges(raw, models["data"][0]["id"], vocab_size)
    )


# Every operation in /openapi.json (test_fuzz_covers_every_operation keeps this list honest).
# Listed rather than discovered so each gets its own test id without a server at collection.
# (schemathesis' own pytest plugin, @schema.parametrize(), fails under pytest 9.2: it sets
# Function._nodeid, which pytest renamed.)
FUZZ_OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/debug/timeline"),
]
# Negative cases need an input to break: operations with a body or query parameters.
WITH_INPUT = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
              "/detokenize", "/debug/timeline"}
GENERATES = {"/v1/completions", "/v1/chat/completions"}
FUZZ_EXAMPLES = 30
FUZZ_CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode}")
    for method, path in FUZZ_OPERATIONS
    for mode in ("positive", "negative", "served")
    if mode == "positive"
    or (mode == "negative" and path in WITH_INPUT)
    or (mode == "served" and path in GENERATES)
]


def test_fuzz_covers_every_operation(api_schema: Any) -> None:
    found = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert found == set(FUZZ_OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), FUZZ_CASES)
def test_schemathesis_no_server_errors(
    request: pytest.FixtureRequest, fuzz_server: ServerProcess, method: str, path: str,
    mode: str
) -> None:
    """schemathesis-generated requests never get a 5xx, and every error answer is
    OpenAI-shaped without internals. ``positive``/``negative``: valid / invalid against the
    published /openapi.json; ``served``: valid within the ranges the server enforces, so the
    requests reach the engine (and at least a third of them must succeed)."""
    schema = request.getfixturevalue("served_schema" if mode == "served" else "api_schema")
    generation_mode = GenerationMode.NEGATIVE if mode == "negative" else GenerationMode.POSITIVE
    operation = schema[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=generation_mode))
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        response = case.call_and_validate(
            base_url=fuzz_server.url, headers=ENV_AUTH, checks=[not_a_server_error], timeout=60
        )
        statuses.append(response.status_code)
        assert response.status_code != 401, response.text  # the key must not mask the answer
        if response.status_code >= 400:  # (generated text is random tokens: may hold ".py")
            check_error_body(response.text)

    run()
    if mode == "served":
        assert statuses.count(200) * 3 >= len(statuses), statuses


def test_fuzz_server_healthy_afterwards(fuzz_server: ServerProcess) -> None:
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(fuzz_server.url + "/v1/completions", headers=ENV_AUTH, timeout=30,
                   json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    metrics = httpx.get(fuzz_server.url + "/metrics", timeout=10).text
    assert metric_value(metrics, "tailserve:num_requests_running") == 0
    assert metric_value(metrics, "tailserve:num_requests_waiting") == 0
    out = fuzz_server.output()
    assert "Traceback" not in out, out


# ------------------------------------------------------------------------------ slow clients
HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(["--header-timeout", str(HEADER_TIMEOUT_S)], model=tiny_model_dir,
                       env=NO_KEY_ENV) as srv:
        yield srv


def _drip(sock: socket.socket, data: bytes, every_s: float) -> float:
    """Send ``data`` a byte every ``every_s`` until the server closes; return when it did
    (seconds after the first byte)."""
    import time

    start = time.monotonic()
    for b in data:
        try:
            sock.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            break
        sock.settimeout(every_s)
        try:
            sock.recv(65536, socket.MSG_PEEK)  # returns once the server answered or closed
            break
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
    return time.monotonic() - start


def test_headers_sent_a_byte_a_second_are_cut_off(slow_server: ServerProcess) -> None:
    import time

    head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=30) as s:
        start = time.monotonic()
        elapsed = _drip(s, head, 1.0)
        s.settimeout(5)
        data = read_until_closed(s)
        closed_after = time.monotonic() - start
    assert elapsed < HEADER_TIMEOUT_S + 1.0
    assert HEADER_TIMEOUT_S - 0.1 <= closed_after <= HEADER_TIMEOUT_S + 1.0, closed_after
    assert data.startswith(b"HTTP/1.1 408 "), data
    check_error_body(data.partition(b"\r\n\r\n")[2].decode())


def test_normal_and_slow_body_requests_are_unaffected(slow_server: ServerProcess) -> None:
    """The bound is on the headers: a body that takes longer than it, and a second request on
    a kept-alive connection after a pause shorter than it, are served; a second request whose
    headers drip is cut off like the first."""
    import time

    payload = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode())
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=30) as s:
        s.sendall(head)
        for i in range(0, len(payload), len(payload) // 4 + 1):  # the body over ~3 s
            time.sleep(0.75)
            s.sendall(payload[i : i + len(payload) // 4 + 1])
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        while b"}}" not in first and b'"usage"' not in first:
            first += s.recv(65536)
        time.sleep(HEADER_TIMEOUT_S / 2)
        s.sendall(head + payload)
        second = s.recv(65536)
        assert second.startswith(b"HTTP/1.1 200 "), second
        time.sleep(0.2)
        while True:  # drain the rest of the second response
            s.settimeout(0.5)
            try:
                if not s.recv(65536):
                    break
            except TimeoutError:
                break
        start = time.monotonic()
        _drip(s, head, 1.0)
        s.settimeout(5)
        data = read_until_closed(s)
        assert time.monotonic() - start <= HEADER_TIMEOUT_S + 1.0
        assert b"408" in data, data
    r = httpx.get(slow_server.url + "/health", timeout=5)
    assert r.status_code == 200
