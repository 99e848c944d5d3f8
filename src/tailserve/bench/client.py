"""The wire: one streamed request, timed chunk by chunk.

Timing rules (the same as vLLM's ``bench serve``; docs/tools.md, "Metrics", states them):

- the clock is ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux), read once per network
  read: every SSE event that arrived in the same read gets the same timestamp, because that
  is when the client could first have seen it;
- a *content chunk* is an event whose first choice carries non-empty text (``text`` for
  completions, ``delta.content`` or ``delta.reasoning_content`` for chat) or a piece of a
  tool call (``delta.tool_calls`` with a name or an arguments fragment: the model wrote
  it); role-only, empty, usage-only and ``[DONE]`` events are not tokens and do not start
  or split time;
- TTFT = send → first content chunk; ITL = the gaps between consecutive content chunks;
  E2EL = send → the read that completed the response (``[DONE]`` or end of stream).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import msgspec

if TYPE_CHECKING:
    from tailserve.bench.datasets import BenchRequest

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
# vLLM's backend names for the two endpoints, so a result file reads like vLLM's.
BACKEND_NAMES: dict[str, str] = {"completions": "openai", "chat": "openai-chat"}
_ERROR_BODY_LIMIT = 64 << 10


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds on the step's clock (0 = start)."""

    index: int
    request_id: str
    prompt_len: int  # the dataset's count, as vLLM counts it (the raw prompt text)
    output_len: int  # max_tokens asked for
    scheduled_s: float  # when the arrival process said to send it
    send_s: float | None = None  # when it was actually sent (None: never sent)
    end_s: float | None = None  # when the client was done with it, success or not
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    output_tokens: int | None = None
    output_tokens_source: str | None = None  # "usage" | "tokenizer" | "chunks"
    server_prompt_tokens: int | None = None  # usage.prompt_tokens (after any chat template)
    status: int | None = None  # HTTP status; None when no response came
    error_type: str | None = None  # None means success
    error: str | None = None
    finish_reason: str | None = None
    server_timing: dict[str, Any] | None = None  # tailserve_timing from the final chunk
    text: str = ""
    # Streamed tool calls reassembled by index: {"name", "arguments"} (arguments as sent).
    tool_calls: list[dict[str, str]] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return self.error_type is None and self.send_s is not None

    @property
    def lag_s(self) -> float | None:
        """Scheduled → sent: the client's own delay (or, with --max-concurrency, the wait
        for a free slot). Large values mean the arrivals were not what was asked for."""
        return None if self.send_s is None else self.send_s - self.scheduled_s

    def as_record(self, with_text: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("text", "tool_calls")}
        d["lag_s"] = self.lag_s
        if with_text:
            d["text"] = self.text
            d["tool_calls"] = self.tool_calls
        return d


def build_payload(
    req: BenchRequest,
    endpoint: str,
    model: str,
    ignore_eos: bool,
    extra_body: dict[str, Any] | None = None,
) -> bytes:
    """The JSON body, encoded once before the clock starts (not on the send path)."""
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    else:
        body["messages"] = req.chat_messages()
        body["max_completion_tokens"] = req.output_len
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / tailserve extension: outputs get the asked length
    if req.extra:
        body.update(req.extra)
    if extra_body:
        body.update(extra_body)
    return msgspec.json.encode(body)


# What parsing a streamed event can raise: not JSON, or JSON of the wrong shape (say
# "choices": ["x"]). Either is one failed request, not a run that dies with a traceback.
STREAM_PARSE_ERRORS = (msgspec.DecodeError, AttributeError, TypeError, KeyError, IndexError)


def describe_stream_error(exc: BaseException) -> tuple[str, str]:
    """(error type, message) for one of ``STREAM_PARSE_ERRORS``; both clients use it."""
    if isinstance(exc, msgspec.DecodeError):
        return "bad_json", f"a streamed event is not JSON: {exc}"
    return "bad_response", (
        f"a streamed event has an unexpected shape: {type(exc).__name__}: {exc}"
    )


def describe_http_error(status: int, body: bytes, reason: str | None) -> tuple[str, str]:
    """(error type, message) from an error response: OpenAI's ``{"error": {...}}`` when the
    server sends it, FastAPI's ``{"detail"}``, else the raw text."""
    err_type: str | None = None
    message: str | None = None
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            err_type = err.get("type") or err.get("code")
            message = err.get("message")
        elif isinstance(err, str):
            message = err
        elif "detail" in obj:
            message = str(obj["detail"])
        elif "message" in obj:
            message = str(obj["message"])
    if message is None:
        message = body.decode("utf-8", "replace").strip()[:300] or (reason or "")
    return str(err_type or f"http_{status}"), f"HTTP {status}: {message}"


_DECODE = msgspec.json.Decoder().decode


class BenchClient(Protocol):
    """What the open loop needs from an HTTP client: ``prepare`` runs before the step's
    clock starts (whatever can be built ahead is built there), ``send`` at the scheduled
    time. Implementations: ``StreamClient`` (aiohttp; https and ``--http-client aiohttp``)
    and ``http11.LeanStreamClient`` (plain http)."""

    url: str

    def prepare(self, body: bytes, res: RequestResult) -> bytes: ...

    async def send(self, prepared: bytes, res: RequestResult, t0: float) -> None: ...

    async def close(self) -> None: ...


class StreamClient:
    """Sends one streamed request and fills its ``RequestResult`` (never raises for a
    failed request: a failure is a result, counted by HTTP status and error type)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        headers: dict[str, str],
        timeout_s: float | None,
    ) -> None:
        self.session = session
        self.url = url
        self.headers = {**headers, "Content-Type": "application/json"}
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    def prepare(self, body: bytes, res: RequestResult) -> bytes:
        return body  # aiohttp builds the request itself, on the send path

    async def close(self) -> None:
        pass  # the session (shared, owned by the caller) holds the connections

    async def send(self, body: bytes, res: RequestResult, t0: float) -> None:
        headers = {**self.headers, "x-request-id": res.request_id}
        st = perf_counter()
        res.send_s = st - t0
        try:
            async with self.session.post(
                self.url, data=body, headers=headers, timeout=self.timeout
            ) as resp:
                res.status = resp.status
                if resp.status != 200:
                    # read(n) returns what has arrived so far, which for a body sent in
                    # pieces is only its start: read up to the limit or the end.
                    raw = b""
                    while len(raw) < _ERROR_BODY_LIMIT:
                        data = await resp.content.read(_ERROR_BODY_LIMIT - len(raw))
                        if not data:
                            break
                        raw += data
                    res.error_type, res.error = describe_http_error(resp.status, raw, resp.reason)
                    return
                await self._read_stream(resp, res, st)
        except asyncio.TimeoutError:
            # Before ClientError: aiohttp's ServerTimeoutError is both.
            res.error_type = "timeout"
            res.error = f"no complete response within --timeout {self.timeout_s:g} s"
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            res.error_type = "connection_refused" if refused else "connection_error"
            res.error = str(exc)
        except aiohttp.ServerDisconnectedError:
            res.error_type = "server_disconnected"
            res.error = "the server closed the connection before the response was complete"
        except aiohttp.ClientPayloadError as exc:
            res.error_type = "incomplete_response"
            res.error = str(exc)
        except aiohttp.ClientError as exc:
            res.error_type = "client_error"
            res.error = f"{type(exc).__name__}: {exc}"
        except STREAM_PARSE_ERRORS as exc:
            res.error_type, res.error = describe_stream_error(exc)
        finally:
            res.end_s = perf_counter() - t0

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, res: RequestResult, st: float
    ) -> None:
        parser = SseParser(res, st)
        async for data in resp.content.iter_any():
            parser.feed(data, perf_counter())
        parser.finish()


class SseParser:
    """The response body of a streamed completion, fed read by read, into a
    ``RequestResult``. Both HTTP clients (aiohttp here, the lean one in http11.py) feed it,
    so TTFT, ITL, usage and ``tailserve_timing`` are extracted by one piece of code.

    ``feed`` raises ``msgspec.DecodeError`` for an event that is not JSON and
    AttributeError/TypeError/KeyError/IndexError for JSON of the wrong shape; the caller
    classifies them (``bad_json`` / ``bad_response``)."""

    __slots__ = ("buf", "calls", "done", "last", "now", "pieces", "res", "st", "stream_error")

    def __init__(self, res: RequestResult, st: float) -> None:
        self.res = res
        self.st = st
        self.buf = b""
        self.last = self.now = st
        self.pieces: list[str] = []
        self.calls: dict[int, tuple[list[str], list[str]]] = {}  # index -> (name, arguments)
        self.done = False
        self.stream_error: Any = None

    def feed(self, data: bytes, now: float) -> None:
        """One network read; ``now`` is when it arrived (every event in it shares it)."""
        self.now = now
        buf = self.buf + data
        if b"\n\n" not in buf:
            if b"\r\n\r\n" not in buf:
                self.buf = buf
                return
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self.buf = events.pop()  # an incomplete event waits for the next read
        res = self.res
        for event in events:
            for line in event.split(b"\n"):
                # SSE: "data:" lines carry the payload; ":" comments (pings), "event:"
                # and "id:" lines are not tokens.
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    continue
                obj = _DECODE(payload)
                if not isinstance(obj, dict):
                    continue
                choices = obj.get("choices")
                if choices:
                    c0 = choices[0]
                    text = c0.get("text")
                    called = False
                    if text is None:
                        delta = c0.get("delta") or {}
                        text = delta.get("content") or delta.get("reasoning_content")
                        calls = delta.get("tool_calls")
                        if calls:
                            called = self._calls(calls)
                    if text or called:
                        if res.ttft_s is None:
                            res.ttft_s = now - self.st
                        else:
                            res.itl_s.append(now - self.last)
                        self.last = now
                        if text:
                            self.pieces.append(text)
                    if c0.get("finish_reason"):
                        res.finish_reason = c0["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens")
                    res.server_prompt_tokens = usage.get("prompt_tokens")
                    if res.output_tokens is not None:
                        res.output_tokens_source = "usage"
                timing = obj.get("tailserve_timing")
                if timing:
                    res.server_timing = timing
                if obj.get("error"):
                    self.stream_error = obj["error"]

    def _calls(self, calls: list[Any]) -> bool:
        """OpenAI's streamed tool-call deltas, gathered by index; True when one carried
        a name or an arguments fragment."""
        wrote = False
        for call in calls:
            fn = call.get("function") or {}
            name, args = fn.get("name"), fn.get("arguments")
            slot = self.calls.setdefault(int(call.get("index") or 0), ([], []))
            if name:
                slot[0].append(name)
                wrote = True
            if args:
                slot[1].append(args)
                wrote = True
        return wrote

    def finish(self) -> None:
        """The body ended cleanly: judge the stream as a whole."""
        res = self.res
        res.text = "".join(self.pieces)
        res.tool_calls = [{"name": "".join(name), "arguments": "".join(args)}
                          for _, (name, args) in sorted(self.calls.items())]
        stream_error = self.stream_error
        if stream_error is not None:
            detail = stream_error if isinstance(stream_error, dict) else {"message": stream_error}
            res.error_type = str(detail.get("type") or "stream_error")
            res.error = f"error event mid-stream: {detail.get('message')}"
        elif res.ttft_s is None:
            res.error_type = "no_content"
            res.error = "the stream ended without any generated text"
        elif not self.done and res.finish_reason is None:
            res.error_type = "incomplete_stream"
            res.error = "the stream ended without a finish_reason or [DONE]"
        else:
            res.e2el_s = self.now - self.st
