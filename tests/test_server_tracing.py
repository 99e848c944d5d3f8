"""--otlp-traces-endpoint: a live server exports one span per request to a real OTLP/HTTP
collector, as a child of the client's W3C traceparent, with gen_ai.* and timing attributes."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from server_util import ServerProcess


def test_server_exports_one_span_per_request(
    tiny_model_dir: str, otlp_collector: tuple[str, list[bytes]]
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    endpoint, bodies = otlp_collector
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with ServerProcess(["--otlp-traces-endpoint", endpoint, "--served-model-name", "tiny"],
                       model=tiny_model_dir) as srv:
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            headers={"traceparent": f"00-{trace_id}-{parent}-01", "x-request-id": "trace-me"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 5, "ignore_eos": True, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200
        untraced = httpx.post(srv.url + "/v1/completions", timeout=60,
                              json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert untraced.status_code == 200
        srv.signal()  # shutdown flushes the span processor
        assert srv.wait(60) == 0

    spans: list[Any] = []
    for body in bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
    assert len(spans) == 2
    mine = [s for s in spans if s.trace_id.hex() == trace_id]
    assert len(mine) == 1
    span = mine[0]
    assert span.parent_span_id.hex() == parent
    assert span.name == "chat tiny"
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.response.id"].string_value == "trace-me"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 5
    assert attrs["gen_ai.request.max_tokens"].int_value == 5
    assert attrs["tailserve.timing.output_tokens"].int_value == 5
    assert attrs["tailserve.timing.e2e_s"].double_value > 0
    now_ns = time.time_ns()
    assert span.start_time_unix_nano < span.end_time_unix_nano < now_ns
    other = next(s for s in spans if s.trace_id.hex() != trace_id)
    assert other.name == "text_completion tiny" and not other.parent_span_id
