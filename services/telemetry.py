"""Process-wide observability plumbing: one OpenTelemetry tracer provider, metrics out of the process.

    setup_telemetry(TelemetrySettings.from_config(config), "sluice-routing", registries)  # at start-up
    with tracer().start_as_current_span("run.drive", attributes={...}): ...
    serve_metrics(registry, port)                     # Prometheus /metrics over HTTP

Exporters ([telemetry].exporter): "none" (the default: a no-op tracer, so an unobserved process
pays nothing per span), "otlp" (spans batched off the event loop to [telemetry].endpoint over
[telemetry].protocol, grpc or http/protobuf, and this process's Prometheus metrics pushed there
every [telemetry].metrics_interval_ms), "console" (spans printed as JSON, batched), "memory"
(kept in process for tests to read with `finished_spans()`).

One trace per run crosses processes through the ledger: the gateway's Submit span writes its W3C
`traceparent` on the run row (`traceparent()`), and the routing worker that claims the run opens
its spans under it (`context_of()`). Sampling is decided once, at Submit ([telemetry].sampling,
a fraction of traces); the worker follows the decision carried in the traceparent's flags.

The provider is held here rather than installed as OpenTelemetry's global one: the global can be
set only once per process, while a test process switches exporters between tests. Code that
traces asks `tracer()` at the moment it starts a span, so it always uses the provider set up last.

Metrics of several processes on one host: prometheus_client's multiprocess mode. Start every
process of the host with the same PROMETHEUS_MULTIPROC_DIR (an empty folder made before they
start, e.g. <data_dir>/metrics); each process writes its samples to its own files there, and
whichever process serves a metrics port serves the sum of all of them (`serve_metrics`), so a
second gateway or routing process on the host loses no numbers. Without the variable each
process serves only its own registry and the second one on a port serves nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from sluice.services.otlp_metrics import MetricsPusher, otlp_metric_exporter

from sluice.config import Settings

log = logging.getLogger(__name__)

EXPORTERS = ("none", "console", "memory", "otlp")
PROTOCOLS = ("grpc", "http/protobuf")
UNKNOWN_EXPORTER = "[telemetry].exporter must be one of " + ", ".join(EXPORTERS) + "; got {value!r}"
TRACER_NAME = "sluice"
MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
TRACEPARENT = "traceparent"

_propagator = TraceContextTextMapPropagator()

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/), set beside
# Sluice's own sluice.* attributes on the Submit span and the replica stream's span.
GEN_AI_PROVIDER = "sluice"
GEN_AI_OPERATION = "text_completion"


def gen_ai_request(model: str) -> dict[str, str]:
    """The GenAI attributes every span about one run's generation carries."""
    return {"gen_ai.operation.name": GEN_AI_OPERATION, "gen_ai.provider.name": GEN_AI_PROVIDER,
            "gen_ai.system": GEN_AI_PROVIDER, "gen_ai.request.model": model}


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    exporter: str = "none"               # none | console | memory | otlp
    endpoint: str = "http://127.0.0.1:4317"   # otlp: the collector (http/protobuf: its base URL, :4318)
    protocol: str = "grpc"               # otlp: grpc | http/protobuf
    sampling: float = 1.0                # fraction of runs traced, decided at Submit
    metrics_interval_s: float = 10.0     # otlp: how often this process pushes its metrics; 0 = never

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(UNKNOWN_EXPORTER.format(value=self.exporter))

    @classmethod
    def from_config(cls, config: Settings) -> TelemetrySettings:
        section = config.telemetry
        return cls(exporter=section.exporter, endpoint=section.endpoint, protocol=section.protocol,
                   sampling=section.sampling, metrics_interval_s=section.metrics_interval_ms / 1000)


@dataclass(slots=True)
class _Telemetry:
    provider: TracerProvider | None = None
    tracer: trace.Tracer = trace.NoOpTracer()
    memory: InMemorySpanExporter | None = None
    pusher: MetricsPusher | None = None


_telemetry = _Telemetry()


def _span_exporter(settings: TelemetrySettings) -> SpanExporter:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=settings.endpoint, insecure=settings.endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return HttpExporter(endpoint=settings.endpoint.rstrip("/") + "/v1/traces")


def setup_tracing(settings: TelemetrySettings, service_name: str) -> None:
    """Install this process's tracer provider (replacing, and shutting down, a previous one)."""
    setup_telemetry(settings, service_name, ())


def setup_telemetry(settings: TelemetrySettings, service_name: str,
                    registries: Sequence[CollectorRegistry]) -> None:
    """Tracing for this process and, under "otlp", a pusher of `registries` to the collector."""
    _stop()
    if settings.exporter == "none":
        return
    resource = Resource.create({"service.name": service_name, "service.instance.id": str(os.getpid())})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sampling)))
    memory = None
    if settings.exporter == "memory":
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
    elif settings.exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        # Batched: a span's end only appends to a queue; a thread exports every few seconds.
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(settings)))
        if settings.metrics_interval_s > 0 and registries:
            exporter = otlp_metric_exporter(settings.endpoint, settings.protocol)
            _telemetry.pusher = MetricsPusher(registries, exporter, resource, settings.metrics_interval_s)
            _telemetry.pusher.start()
    _telemetry.provider, _telemetry.memory = provider, memory
    _telemetry.tracer = provider.get_tracer(TRACER_NAME)


def tracer() -> trace.Tracer:
    return _telemetry.tracer


def tracing() -> bool:
    """Whether this process records spans (an exporter is set up). A hot path may skip its spans
    when it does not: a no-op span still costs two generator-based context managers, a switch of the
    current context and the attributes' dict (~20 us a run in the routing worker's four)."""
    return _telemetry.provider is not None


def traceparent() -> str | None:
    """The W3C traceparent of the current span (None when nothing is traced): stored on the run row."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get(TRACEPARENT)


def context_of(parent: str | None) -> otel_context.Context | None:
    """The context a stored traceparent names, for spans of the same trace in another process."""
    if not parent:
        return None
    return _propagator.extract({TRACEPARENT: parent})


def finished_spans(name: str | None = None) -> Sequence[ReadableSpan]:
    """Spans ended so far under the "memory" exporter (empty under the others)."""
    if _telemetry.memory is None:
        return ()
    spans = _telemetry.memory.get_finished_spans()
    return tuple(span for span in spans if name is None or span.name == name)


def _stop() -> None:
    pusher, provider = _telemetry.pusher, _telemetry.provider
    _telemetry.provider, _telemetry.tracer, _telemetry.memory, _telemetry.pusher = (
        None, trace.NoOpTracer(), None, None)
    if pusher is not None:
        pusher.stop()          # pushes one last time
    if provider is not None:
        provider.shutdown()    # flushes the spans still batched


def shutdown_tracing() -> None:
    """Flush and stop the exporters (spans still batched are sent, metrics pushed once more)."""
    _stop()
    if os.environ.get(MULTIPROC_DIR_VARIABLE):
        # Live gauges (budget left, replica load) of a process that ended drop out of the sum.
        multiprocess.mark_process_dead(os.getpid())


def metrics_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """What a metrics port serves: this process's registry, or under multiprocess mode the sum of
    every process's files in PROMETHEUS_MULTIPROC_DIR."""
    path = os.environ.get(MULTIPROC_DIR_VARIABLE)
    if not path:
        return registry
    summed = CollectorRegistry()
    multiprocess.MultiProcessCollector(summed, path=path)
    return summed


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> bool:
    """Expose `registry` at http://host:port/metrics (a daemon thread); False when the port is taken.

    Several processes on one host share the configured port: the first serves it. Under
    multiprocess mode (PROMETHEUS_MULTIPROC_DIR) it serves every process's numbers summed; without
    it the others log that they are not served (they still count; their numbers are not scraped)."""
    try:
        start_http_server(port, addr=host, registry=metrics_registry(registry))
    except OSError as exc:
        log.warning("metrics endpoint %s:%d not served: %s", host, port, exc)
        return False
    return True
