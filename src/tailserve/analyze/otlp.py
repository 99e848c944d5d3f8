"""vLLM's OpenTelemetry request spans, read from a file of OTLP/JSON.

vLLM started with ``--otlp-traces-endpoint`` exports one span per finished request, named
``llm_request`` (kind SERVER, started at the request's arrival, wall clock), with the
request's own timing as attributes (vLLM's ``vllm/tracing/utils.py`` names them; the values
are set in ``v1/engine/output_processor.py``):

- ``gen_ai.request.id``: the request id, ``cmpl-`` or ``chatcmpl-`` + the ``X-Request-Id``
  header, which tailserve bench sets to its own request id: the join key;
- ``gen_ai.latency.time_in_queue``: first scheduled less queued (a later preemption's wait
  is not in it: vLLM keeps the first scheduling time);
- ``gen_ai.latency.time_in_model_prefill``: first token less first scheduled (the request's
  own prompt, the other requests sharing its steps, any preemption before its first token);
- ``gen_ai.latency.time_to_first_token`` and ``gen_ai.latency.e2e`` (the API process's
  clock, from arrival), ``gen_ai.latency.time_in_model_decode``;
- ``gen_ai.usage.prompt_tokens`` and ``gen_ai.usage.completion_tokens``.

vLLM exports over gRPC or HTTP, not to a file; an OpenTelemetry collector between them
writes the file (its ``file`` exporter: JSON lines, one ``{"resourceSpans": [...]}`` export
request a line). One such object pretty-printed over many lines reads too. OTLP/JSON writes
64-bit integers (``intValue``, the ``*UnixNano`` times) as strings; both forms are accepted,
and a gzipped file too.
Spans of other names (vLLM's start-up spans, a proxy's) are skipped.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SPAN_NAME = "llm_request"
A_ID = "gen_ai.request.id"
A_QUEUE = "gen_ai.latency.time_in_queue"
A_PREFILL = "gen_ai.latency.time_in_model_prefill"
A_TTFT = "gen_ai.latency.time_to_first_token"
A_E2E = "gen_ai.latency.e2e"
A_DECODE = "gen_ai.latency.time_in_model_decode"
A_PROMPT = "gen_ai.usage.prompt_tokens"
A_OUTPUT = "gen_ai.usage.completion_tokens"
REQUIRED = (A_ID, A_QUEUE, A_PREFILL, A_TTFT)
# The prefixes vLLM's OpenAI server puts before the X-Request-Id (completions, chat).
ID_PREFIXES = ("chatcmpl-", "cmpl-")


class TraceFileError(ValueError):
    """A traces file diagnose cannot use; the message says what it holds and what it needs."""


@dataclass(frozen=True)
class RequestSpan:
    """One request as vLLM's ``llm_request`` span tells it (seconds; wall clock for times)."""

    request_id: str  # as vLLM wrote it, prefix included
    arrival_t: float | None
    queue_s: float
    prefill_s: float
    ttft_s: float
    e2e_s: float | None
    decode_s: float | None
    prompt_tokens: int | None
    output_tokens: int | None


def _value(v: Any) -> Any:
    """An OTLP/JSON ``AnyValue``: ``{"doubleValue": 0.5}``, ``{"intValue": "224"}``, ..."""
    if not isinstance(v, dict):
        return None
    for key in ("doubleValue", "intValue", "stringValue", "boolValue"):
        if key in v:
            return v[key]
    return None


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if f == f and abs(f) != float("inf") else None


def _objects(text: str) -> Iterator[Any]:
    """The file as one JSON document, else as JSON lines (the collector's file exporter)."""
    try:
        yield json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            raise TraceFileError(f"line {n} is not JSON: the file is neither one OTLP/JSON "
                                 "document nor JSON lines of them") from None


def _spans(obj: Any) -> Iterator[dict[str, Any]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("resourceSpans"), list):
        raise TraceFileError("an object has no resourceSpans list: not OTLP/JSON traces (an "
                             "OpenTelemetry collector's file exporter writes them)")
    for rs in obj["resourceSpans"]:
        for ss in (rs or {}).get("scopeSpans") or []:
            for span in (ss or {}).get("spans") or []:
                if isinstance(span, dict):
                    yield span


def _request_span(span: dict[str, Any]) -> RequestSpan | None:
    """The span's timing, or None when it lacks one of the attributes diagnose needs."""
    attrs = {a.get("key"): _value(a.get("value")) for a in span.get("attributes") or []
             if isinstance(a, dict)}
    if attrs.get(A_ID) is None:
        return None
    need = [_number(attrs.get(k)) for k in (A_QUEUE, A_PREFILL, A_TTFT)]
    if any(x is None or x < 0 for x in need):
        return None
    queue, prefill, ttft = (float(x) for x in need if x is not None)
    start = _number(span.get("startTimeUnixNano"))

    def count(key: str) -> int | None:
        x = _number(attrs.get(key))
        return None if x is None else int(x)

    return RequestSpan(request_id=str(attrs[A_ID]),
                       arrival_t=None if not start else start / 1e9,
                       queue_s=queue, prefill_s=prefill, ttft_s=ttft,
                       e2e_s=_number(attrs.get(A_E2E)), decode_s=_number(attrs.get(A_DECODE)),
                       prompt_tokens=count(A_PROMPT), output_tokens=count(A_OUTPUT))


def read_spans(path: str) -> list[RequestSpan]:
    """Every usable ``llm_request`` span in ``path``; TraceFileError when there is none."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        # A gzipped file (a rotated collector file, or one gzipped to keep) reads as is.
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as exc:
        raise TraceFileError(f"cannot read the traces {path}: {exc}") from None
    total = named = 0
    out = []
    try:
        for obj in _objects(text):
            for span in _spans(obj):
                total += 1
                if span.get("name") != SPAN_NAME:
                    continue
                named += 1
                rs = _request_span(span)
                if rs is not None:
                    out.append(rs)
    except TraceFileError as exc:
        raise TraceFileError(f"--otlp-traces {path}: {exc}") from None
    if not out:
        what = (f"{named} {SPAN_NAME} spans, none with {', '.join(REQUIRED)}" if named
                else f"{total} spans, none named {SPAN_NAME}")
        raise TraceFileError(f"--otlp-traces {path}: {what}; vLLM writes them when started "
                             "with --otlp-traces-endpoint")
    return out


def bare_id(request_id: str) -> str:
    """vLLM's request id less the prefix its OpenAI server adds: the X-Request-Id sent."""
    for p in ID_PREFIXES:
        if request_id.startswith(p):
            return request_id[len(p):]
    return request_id


def match_spans(spans: list[RequestSpan], request_ids: list[str]) -> dict[str, RequestSpan]:
    """request id -> its span (by id, or by id less vLLM's prefix and prompt index); the last
    span wins when a file holds one request twice (a collector that retried an export)."""
    wanted = set(request_ids)
    out: dict[str, RequestSpan] = {}
    for s in spans:
        bare = bare_id(s.request_id)
        # /v1/completions takes a list of prompts, so vLLM 0.32 names each one's request
        # ``cmpl-<X-Request-Id>-<prompt index>`` (a real server's spans: cmpl-bench-…-0-0-0).
        for key in (s.request_id, bare, bare.rsplit("-", 1)[0]):
            if key in wanted:
                out[key] = s
                break
    return out
