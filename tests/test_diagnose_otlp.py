"""diagnose --otlp-traces: vLLM's request spans (OTLP/JSON, as an OpenTelemetry collector's
file exporter writes them) give each request's queue, prefill and server-side TTFT, so the
TTFT decomposition is measured per request and the client's time is judged.

The span files under fixtures/diagnose/ are what a real vLLM 0.32 exported for the recorded
runs beside them (`--otlp-traces-endpoint` into the peers harness's collector; README there);
their format is checked against the OTLP protobuf schema below, and against what the
OpenTelemetry SDK's own encoder writes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tailserve.analyze.data import DiagnoseError, attach_spans, load_run, run_from_result
from tailserve.analyze.diagnose import Diagnosis, diagnose
from tailserve.analyze.otlp import RequestSpan, TraceFileError, bare_id, read_spans
from tailserve.analyze.report import render_html
from tailserve.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "diagnose"
STARVED_SPANS = FIXTURES / "vllm-starved-spans.jsonl.gz"
CLEAN_SPANS = FIXTURES / "vllm-clean-single-spans.jsonl.gz"
WORST = "bench-684a4674-0-11"  # the starved run's longest TTFT


def span_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def result(name: str, tmp_path: Path) -> str:
    path = tmp_path / f"{name}.json"
    with gzip.open(FIXTURES / f"{name}.json.gz", "rt", encoding="utf-8") as f:
        path.write_text(f.read(), encoding="utf-8")
    return str(path)


def with_spans(name: str, spans: Path, tmp_path: Path) -> Diagnosis:
    return diagnose(load_run(result(name, tmp_path), None, str(spans)))


# ---------------------------------------------------------------- the file
def test_the_collector_file_is_otlp_json_and_reads_every_request_span() -> None:
    pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    from google.protobuf import json_format

    # The protobuf schema's JSON parser rejects any field OTLP does not have.
    for line in span_lines(STARVED_SPANS):
        json_format.Parse(line, pb.ExportTraceServiceRequest())
    spans = read_spans(str(STARVED_SPANS))
    # One vLLM served both recorded runs: 12 + 10 requests and each bench's pre-flight
    # request; its start-up spans (loading, the worker's own) are skipped.
    assert len(spans) == 24
    # /v1/completions takes a list of prompts: vLLM names each cmpl-<X-Request-Id>-<index>.
    last = next(s for s in spans if s.request_id == f"cmpl-{WORST}-0")
    assert (last.queue_s, last.prefill_s, last.ttft_s) == pytest.approx(
        (14.676057, 0.4288105, 15.447081))
    assert (last.prompt_tokens, last.output_tokens) == (224, 64)
    assert last.e2e_s == pytest.approx(last.ttft_s + last.decode_s, abs=1e-3)
    assert last.arrival_t == pytest.approx(1796397311.529241)
    assert bare_id(last.request_id) == f"{WORST}-0"
    assert bare_id("chatcmpl-x-1") == "x-1" and bare_id("plain") == "plain"


def test_what_the_sdk_encoder_writes_reads_too(tmp_path: Path) -> None:
    # A span made by the OpenTelemetry SDK with vLLM's names, encoded by the OTLP exporter's
    # own encoder and written as protobuf JSON (one pretty-printed document, enum names,
    # int64 as strings): the reader takes it as it takes the collector's lines.
    pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder")
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.tracing.otel")
    attrs: dict[str, str | float | int] = {
        "gen_ai.request.id": "chatcmpl-r1", "gen_ai.latency.time_in_queue": 0.25,
        "gen_ai.latency.time_in_model_prefill": 0.125,
        "gen_ai.latency.time_to_first_token": 0.5, "gen_ai.usage.prompt_tokens": 1000}
    span = tracer.start_span("llm_request", kind=SpanKind.SERVER,
                             start_time=1_700_000_000_000_000_000, attributes=attrs)
    span.end()
    path = tmp_path / "sdk.json"
    path.write_text(json_format.MessageToJson(encode_spans(exporter.get_finished_spans())))
    [s] = read_spans(str(path))
    assert s == RequestSpan("chatcmpl-r1", 1_700_000_000.0, 0.25, 0.125, 0.5, None, None, 1000,
                            None)


def test_the_peers_harness_collector_writes_what_diagnose_reads(tmp_path: Path) -> None:
    # make peers-test points vLLM at benchmarks/peers/span_collector.py: an OTLP/HTTP
    # protobuf export in, one OTLP/JSON line out.
    pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder")
    import sys
    import urllib.request

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
    from span_collector import SpanFileCollector

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.tracing.otel")
    for i in range(2):
        tracer.start_span("llm_request", start_time=(1_700_000_000 + i) * 10**9, attributes={
            "gen_ai.request.id": f"cmpl-bench-x-0-{i}", "gen_ai.latency.time_in_queue": 0.5 * i,
            "gen_ai.latency.time_in_model_prefill": 0.25,
            "gen_ai.latency.time_to_first_token": 1.0}).end()
    collector = SpanFileCollector(str(tmp_path / "spans.jsonl"))
    collector.start()
    try:
        for span in exporter.get_finished_spans():  # one export request each, as batches come
            req = urllib.request.Request(collector.url, method="POST", headers={
                "Content-Type": "application/x-protobuf"},
                data=encode_spans([span]).SerializeToString())
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
    finally:
        collector.stop()
    assert collector.requests == 2
    assert len((tmp_path / "spans.jsonl").read_text(encoding="utf-8").splitlines()) == 2
    spans = read_spans(str(tmp_path / "spans.jsonl"))
    assert [(s.request_id, s.queue_s, s.arrival_t) for s in spans] == [
        ("cmpl-bench-x-0-0", 0.0, 1_700_000_000.0), ("cmpl-bench-x-0-1", 0.5, 1_700_000_001.0)]


# ---------------------------------------------------------------- the decomposition
def test_spans_measure_each_requests_ttft_parts(tmp_path: Path) -> None:
    d = with_spans("vllm-starved", STARVED_SPANS, tmp_path)
    dec = d.as_json()["ttft_decomposition"]
    assert dec["method"] == "spans" and "llm_request spans" in dec["about"]
    # bench ran on vLLM's host: the CPU other work took is a part too (none here).
    assert dec["parts"] == ["queueing", "kv_cache_pressure", "own_prefill",
                            "prefill_interference", "client_or_network", "cpu_contention"]
    spans = {bare_id(s.request_id).rsplit("-", 1)[0]: s
             for s in read_spans(str(STARVED_SPANS))}
    # The quickest prefill price of the run: the 10th percentile of prefill s per token over
    # its own 12 requests (the file also holds the other run's on that server).
    per_token = sorted(spans[q.request_id].prefill_s / 224 for q in d.run.requests)
    assert len(per_token) == 12
    price = per_token[1] + 0.1 * (per_token[2] - per_token[1])
    client = {q.request_id: q.ttft_s for q in d.run.requests}
    for r in dec["requests"]:
        sp, p = spans[r["request_id"]], r["parts_ms"]
        assert r["method"] == "spans"
        # vLLM's measured queue time, split by the gauges between a slot and KV blocks.
        assert p["queueing"] + p["kv_cache_pressure"] == pytest.approx(sp.queue_s * 1e3,
                                                                        abs=2e-3)
        # Its prefill window: the prompt at the run's quickest price, the rest interference.
        assert p["own_prefill"] == pytest.approx(min(sp.prefill_s, price * 224) * 1e3, abs=1e-3)
        assert p["own_prefill"] + p["prefill_interference"] == pytest.approx(sp.prefill_s * 1e3,
                                                                              abs=2e-3)
        assert p["client_or_network"] == pytest.approx(
            max(0.0, client[r["request_id"]] - sp.ttft_s) * 1e3, abs=1e-3)
    last = next(r for r in dec["requests"] if r["request_id"] == WORST)
    assert last["parts_ms"]["client_or_network"] == pytest.approx(20.7, abs=0.05)
    # The planted cause still leads; the client's time is judged now, step stalls are not.
    assert d.tails["ttft"].causes[0].cause == "kv_cache_pressure"
    assert d.cannot_judge == ["engine_stall"]
    assert "gen_ai.latency.time_in_queue" in d.tails["ttft"].causes[0].basis


def test_without_spans_the_same_run_is_fitted_and_client_time_unjudged(tmp_path: Path) -> None:
    d = diagnose(load_run(result("vllm-starved", tmp_path)))
    assert d.as_json()["ttft_decomposition"]["method"] == "fitted"
    assert "client_or_network" in d.cannot_judge
    assert "--otlp-traces" in d.cannot_why["client_or_network"]


def test_a_clean_run_with_spans_still_reads_none(tmp_path: Path) -> None:
    d = with_spans("vllm-clean-single", CLEAN_SPANS, tmp_path)
    assert d.as_json()["ttft_decomposition"]["method"] == "spans"
    for m in d.tails:
        assert [c.cause for c in d.tails[m].causes] == ["none"], d.as_json()["tail"][m]


def test_requests_without_a_span_keep_fitted_parts_and_say_so(tmp_path: Path) -> None:
    lines = span_lines(STARVED_SPANS)
    part = tmp_path / "part.jsonl"
    part.write_text("\n".join(lines[:5]) + "\n", encoding="utf-8")  # 5 of 12 (as exported)
    d = with_spans("vllm-starved", part, tmp_path)
    rows = d.as_json()["ttft_decomposition"]["requests"]
    assert sorted(r["method"] for r in rows) == ["fitted"] * 7 + ["spans"] * 5
    assert d.run.notes == [f"7 of 12 completed requests have no llm_request span in {part}: "
                           "their first-token parts are fitted"]
    assert d.as_json()["notes"] == d.run.notes


def test_html_report_tables_the_slowest_first_tokens(tmp_path: Path) -> None:
    page = render_html(with_spans("vllm-starved", STARVED_SPANS, tmp_path))
    table = page.split("<table id='ttft-parts'>", 1)[1].split("</table>", 1)[0]
    assert "vLLM&#x27;s llm_request spans" in page
    rows = table.split("<tr>")[2:]
    assert len(rows) == 10 and WORST in rows[0]
    assert "<th>client_or_network (ms)</th>" in table and "<td>20.7</td>" in rows[0]


def test_the_command_reads_a_gzipped_file_and_prints_the_spans_view(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = STARVED_SPANS
    res = result("vllm-starved", tmp_path)
    assert main(["diagnose", res, "--otlp-traces", str(traces), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft_decomposition"]["method"] == "spans" and out["notes"] == []
    assert out["cannot_judge"] == ["engine_stall"]
    assert main(["diagnose", res, "--otlp-traces", str(traces)]) == 0
    text = capsys.readouterr().out
    assert "vLLM's llm_request spans: 12 of 12 requests" in text


# ---------------------------------------------------------------- bad input
def _otlp(spans: list[dict[str, Any]]) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]})


@pytest.mark.parametrize(("content", "says"), [
    ("not json at all\n{", "line 1 is not JSON"),
    ('{"ttfts": [1, 2]}', "has no resourceSpans list: not OTLP/JSON traces"),
    (_otlp([{"name": "Overall Loading"}]), "1 spans, none named llm_request"),
    (_otlp([{"name": "llm_request", "attributes": [
        {"key": "gen_ai.request.id", "value": {"stringValue": "cmpl-x"}}]}]),
     "1 llm_request spans, none with gen_ai.request.id, gen_ai.latency.time_in_queue"),
    (_otlp([{"name": "llm_request", "attributes": [
        {"key": k, "value": {"doubleValue": 0.1}} for k in (
            "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
            "gen_ai.latency.time_to_first_token")]
        + [{"key": "gen_ai.request.id", "value": {"stringValue": "cmpl-other-run-0"}}]}]),
     "none of its 1 llm_request spans (ids like cmpl-other-run-0) is a request of this run"),
])
def test_bad_traces_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            content: str, says: str) -> None:
    traces = tmp_path / "traces.json"
    traces.write_text(content, encoding="utf-8")
    rc = main(["diagnose", result("vllm-starved", tmp_path), "--otlp-traces", str(traces)])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_spans_on_a_run_that_is_not_vllms_are_refused(tmp_path: Path) -> None:
    spans = read_spans(str(STARVED_SPANS))
    with gzip.open(FIXTURES / "llama-queue.json.gz", "rt", encoding="utf-8") as f:
        llama = run_from_result(json.load(f))
    with pytest.raises(DiagnoseError, match="the run's /metrics are llama-server's"):
        attach_spans(llama, spans, "t.jsonl")
    with gzip.open(FIXTURES / "tailserve-clean-single.json.gz", "rt", encoding="utf-8") as f:
        ours = run_from_result(json.load(f))
    with pytest.raises(DiagnoseError, match="tailserve's own per-request timing"):
        attach_spans(ours, spans, "t.jsonl")
    with pytest.raises(TraceFileError, match="cannot read the traces"):
        read_spans(str(FIXTURES / "absent.jsonl"))
    # The collector's file exporter with format: proto, and a gzip cut short.
    (tmp_path / "spans.pb").write_bytes(b"\n\xa4\x05\n\x8d\x01\n\xff\xfe")
    (tmp_path / "cut.gz").write_bytes(gzip.compress(b'{"resourceSpans": []}')[:12])
    for name in ("spans.pb", "cut.gz"):
        with pytest.raises(TraceFileError, match="cannot read the traces"):
            read_spans(str(tmp_path / name))
