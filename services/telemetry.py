"""Process-wide observability plumbing: one OpenTelemetry tracer provider, a Prometheus endpoint.

    setup_tracing(TelemetrySettings.from_config(config), "sluice-routing")   # once, at start-up
    with tracer().start_as_current_span("run.drive", attributes={...}): ...
    serve_metrics(registry, port)                                           # /metrics over HTTP

Exporters ([telemetry].exporter): "none" (the default: a no-op tracer, so an
unobserved process pays nothing per span), "console" (spans printed as JSON,
batched off the event loop), "memory" (kept in process for tests to read with
`finished_spans()`).

The provider is held here rather than installed as OpenTelemetry's global one:
the global can be set only once per process, while a test process switches
exporters between tests. Code that traces asks `tracer()` at the moment it
starts a span, so it always uses the provider set up last.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, start_http_server

from sluice.config import Settings

log = logging.getLogger(__name__)

EXPORTERS = ("none", "console", "memory")
UNKNOWN_EXPORTER = "[telemetry].exporter must be one of " + ", ".join(EXPORTERS) + "; got {value!r}"
TRACER_NAME = "sluice"


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    exporter: str = "none"               # none | console | memory

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(UNKNOWN_EXPORTER.format(value=self.exporter))

    @classmethod
    def from_config(cls, config: Settings) -> TelemetrySettings:
        return cls(exporter=config.telemetry.exporter)


@dataclass(slots=True)
class _Tracing:
    provider: TracerProvider | None = None
    tracer: trace.Tracer = trace.NoOpTracer()
    memory: InMemorySpanExporter | None = None


_tracing = _Tracing()


def setup_tracing(settings: TelemetrySettings, service_name: str) -> None:
    """Install this process's tracer provider (replacing, and shutting down, a previous one)."""
    previous = _tracing.provider
    if settings.exporter == "none":
        _tracing.provider, _tracing.tracer, _tracing.memory = None, trace.NoOpTracer(), None
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        memory = None
        if settings.exporter == "memory":
            memory = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(memory))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        _tracing.provider, _tracing.memory = provider, memory
        _tracing.tracer = provider.get_tracer(TRACER_NAME)
    if previous is not None:
        previous.shutdown()


def tracer() -> trace.Tracer:
    return _tracing.tracer


def finished_spans(name: str | None = None) -> Sequence[ReadableSpan]:
    """Spans ended so far under the "memory" exporter (empty under the others)."""
    if _tracing.memory is None:
        return ()
    spans = _tracing.memory.get_finished_spans()
    return tuple(span for span in spans if name is None or span.name == name)


def shutdown_tracing() -> None:
    """Flush and stop the exporter (console spans still batched are printed)."""
    if _tracing.provider is not None:
        _tracing.provider.shutdown()
    _tracing.provider, _tracing.tracer, _tracing.memory = None, trace.NoOpTracer(), None


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> bool:
    """Expose `registry` at http://host:port/metrics (a daemon thread); False when the port is taken.

    Several routing processes on one host share the configured port: the first serves it, the
    others log that they do not (they still count; their numbers are lost, not wrong)."""
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("metrics endpoint %s:%d not served: %s", host, port, exc)
        return False
    return True
