"""A stand-in for an OpenTelemetry collector with a file exporter, for the peers harness.

vLLM started with ``--otlp-traces-endpoint URL`` and ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf`` POSTs its spans to ``URL`` as OTLP/HTTP protobuf; this server decodes each
export request and appends it to a file as one line of OTLP/JSON, which is what
``tailserve diagnose --otlp-traces`` reads. Why not a real collector: the harness must run
where only the peers are installed; opentelemetry-proto comes with tailserve's ``otel``
extra. The one difference from the collector's file exporter: protobuf's JSON writes trace and
span ids in base64 where the collector writes hex; diagnose reads neither.
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class SpanFileCollector:
    """``start()``, point the engine at ``url``, ``stop()``; the spans are in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.requests = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_error(404, "only /v1/traces")
                    return
                collector.write(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                        daemon=True)

    def write(self, msg: ExportTraceServiceRequest) -> None:
        line = json_format.MessageToJson(msg, indent=None)
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line.replace("\n", " ") + "\n")
            self.requests += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
