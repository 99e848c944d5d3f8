"""Optional OpenTelemetry tracing: one span per finished request, exported over OTLP/HTTP.

Install with ``pip install 'tailserve[otel]'``. The span is built after the fact from the
request's record (wall-clock start/end, engine timing as attributes) rather than kept open
while the request runs: nothing touches the hot path, and a span cannot leak when a client
disconnects. A W3C ``traceparent`` header from the client makes the span its child, so the
server's time shows up inside the caller's trace.

Attribute names follow the OpenTelemetry GenAI conventions (``gen_ai.*``); the
``tailserve_timing`` fields go under ``tailserve.timing.<name>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tailserve.data.records import RequestRecord
from tailserve.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

INSTALL_HINT = "pip install 'tailserve[otel]'"


def make_tracer(endpoint: str | None, service_name: str = "tailserve") -> RequestTracer | None:
    """A tracer exporting to ``endpoint`` (the full URL, e.g. http://host:4318/v1/traces).

    None when no endpoint is configured; ConfigError when one is but OpenTelemetry is missing,
    so a misconfigured deployment fails at start-up rather than silently dropping traces.
    """
    if endpoint is None:
        return None
    return RequestTracer(endpoint, service_name=service_name)


class RequestTracer:
    """Owns its TracerProvider (the global one is left to the application embedding us)."""

    def __init__(self, endpoint: str, service_name: str = "tailserve") -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise ConfigError(
                f"an OTLP endpoint was given ({endpoint!r}) but OpenTelemetry is not installed "
                f"({e.name or e}): {INSTALL_HINT}"
            ) from e
        self.endpoint = endpoint
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name})
        )
        # Batching: export happens on the processor's thread, never in the request path.
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("tailserve")
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace  # the API module, kept so record() needs no import of its own

    def record(
        self,
        rec: RequestRecord,
        *,
        traceparent: str | None,
        attributes: dict[str, Any],
        start_wall: float,
        end_wall: float,
    ) -> None:
        """Emit the span of one finished request (``start_wall``/``end_wall``: time.time())."""
        attrs = _span_attributes(rec, attributes)
        operation = attrs.get("gen_ai.operation.name", "request")
        model = attrs.get("gen_ai.request.model")
        name = f"{operation} {model}" if model else str(operation)
        # An absent or malformed traceparent yields an empty context: the span becomes a root.
        carrier = {"traceparent": traceparent} if traceparent else {}
        parent = self._propagator.extract(carrier)
        span = self._tracer.start_span(
            name,
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes=attrs,
            start_time=_ns(start_wall),
        )
        if rec.error_type is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, rec.error_type))
        span.end(end_time=_ns(max(end_wall, start_wall)))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter thread."""
        self._provider.shutdown()


def _span_attributes(rec: RequestRecord, given: dict[str, Any]) -> dict[str, Any]:
    # Defaults come from the record; what the edge passes wins (it knows e.g. the model alias
    # the client asked for). OTel drops None values with a warning, so they are left out here.
    attrs: dict[str, Any] = {
        "gen_ai.system": "tailserve",
        "gen_ai.response.id": rec.request_id,
        "gen_ai.usage.input_tokens": rec.prompt_tokens,
        "gen_ai.usage.output_tokens": rec.output_tokens,
    }
    if rec.model is not None:
        attrs["gen_ai.request.model"] = rec.model
    if rec.finish_reason is not None:
        attrs["gen_ai.response.finish_reasons"] = [rec.finish_reason]
    if rec.error_type is not None:
        attrs["error.type"] = rec.error_type
    attrs.update({k: v for k, v in given.items() if v is not None})
    for key, value in (rec.timing or {}).items():
        if value is not None:
            attrs[f"tailserve.timing.{key}"] = value
    return attrs


def _ns(wall_s: float) -> int:
    return int(wall_s * 1e9)
