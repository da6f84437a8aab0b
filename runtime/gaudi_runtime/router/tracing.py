"""OpenTelemetry traces of requests (--otlp-endpoint, --otlp-service-name), exported over OTLP/HTTP.

One trace per HTTP request: a `request` span with `validation`, `queue`, `prefill` and `decode`
children, built when the request ends from the times the router already keeps (so the batching
loop does no tracing work). Without --otlp-endpoint nothing here is imported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from gaudi_runtime.config import ServerConfig

log = logging.getLogger(__name__)


@dataclass
class RequestTimes:
    """Monotonic seconds of one request's phases, and what the spans carry as attributes."""

    start: float
    end: float
    validated: float | None = None
    first_token: float | None = None
    queue_time: float = 0.0  # seconds, from the engine's GenerationEnd
    attributes: dict = field(default_factory=dict)


def phases(t: RequestTimes) -> list[tuple[str, float, float]]:
    """(name, start, end) of the child spans that happened, in order, clipped to the request."""
    out = []
    validated = t.validated if t.validated is not None else t.end
    out.append(("validation", t.start, validated))
    if t.validated is None:
        return out
    queued_until = min(t.end, validated + t.queue_time)
    out.append(("queue", validated, queued_until))
    first = t.first_token if t.first_token is not None else t.end
    out.append(("prefill", queued_until, max(queued_until, first)))
    if t.first_token is not None:
        out.append(("decode", first, t.end))
    return out


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces path under a collector address given as in TGI (scheme://host:port)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class RequestTracer:
    def __init__(self, endpoint: str, service_name: str):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # A provider of our own (not the global one): the process may embed other OpenTelemetry users.
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("gaudi_runtime.router")
        # Spans need wall-clock nanoseconds; the router measures with the monotonic clock.
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        log.info("exporting request traces to %s as %s", traces_url(endpoint), service_name)

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def record(self, t: RequestTimes) -> None:
        from opentelemetry import trace

        root = self.tracer.start_span("request", start_time=self._ns(t.start), attributes=t.attributes)
        ctx = trace.set_span_in_context(root)
        for name, start, end in phases(t):
            span = self.tracer.start_span(name, context=ctx, start_time=self._ns(start))
            span.end(end_time=self._ns(end))
        root.end(end_time=self._ns(t.end))

    def shutdown(self) -> None:
        """Flush what is buffered and stop the exporter."""
        self.provider.shutdown()


def make_tracer(server: ServerConfig) -> RequestTracer | None:
    if not server.otlp_endpoint:
        return None
    return RequestTracer(server.otlp_endpoint, server.otlp_service_name)
