"""What tracing and metrics add to one run's hot path: `python -m bench.bench_telemetry [-n 20000]`.

Times, in process and without servers, the instrumentation each run pays for, exactly as the code
does it: the gateway's Submit (its span with the GenAI attributes, the traceparent written on the
run row, the latency histogram) and the routing worker's (run.claim from the stored traceparent,
run.drive, the replica stream's span with its end attributes, run.settle, the run's metrics).
Three setups: [telemetry].exporter = "none" (the default no-op tracer), "otlp" with every trace
sampled (spans batched to an in-process OTLP collector over gRPC, metrics pushed every 100 ms), and
"otlp" at sampling 0.1. Prints CPU microseconds per run and per Submit (process time, the export
thread included); never fails on timing. Set
against a Submit's ~1-3 ms (bench_submit) and a run's tens of tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from sluice.ledger.models import RunStatus
from sluice.services import telemetry
from sluice.services.finish import Ending
from sluice.services.gateway_metrics import GatewayMetrics, submit_span_attributes
from sluice.services.routing.claims import ClaimedRun
from sluice.services.routing.observability import (
    RoutingMetrics,
    RunOutcome,
    claim_attributes,
    stream_attributes,
    stream_end_attributes,
    stream_span_name,
)
from sluice.services.telemetry import TelemetrySettings

from sluice.router.policy import RouteDecision


class _Sink(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.spans += sum(len(scope.spans) for resource in request.resource_spans
                              for scope in resource.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        return metrics_service_pb2.ExportMetricsServiceResponse()


CLAIM = ClaimedRun(run_id=str(uuid.uuid4()), tenant_id=uuid.uuid4(), model_version="tiny-chat-v1",
                   worker_pool="tiny-chat-v1", tokenizer="", end_id=0, prompt_token_ids=(1, 2, 3),
                   input_tokens=512, max_output_tokens=64, conversation_id=None,
                   deadline_at=dt.datetime.now(dt.UTC), replica="r0", queued_at=None)
DECISION = RouteDecision(replica="r0", outcome="affinity_hit", predicted_cached_tokens=256)
ENDING = Ending(RunStatus.COMPLETED, last_sequence=66, output_tokens=64, cached_input_tokens=256)
OUTCOME = RunOutcome(RunStatus.COMPLETED, "r0", 1, 512, 64, 256, 256, 0.12, 0.007)


def submit_once(metrics: GatewayMetrics) -> str | None:
    started = time.perf_counter()
    attributes = submit_span_attributes("chat", 64, {"temperature": 0.0, "top_p": 0.0, "seed": 0})
    with telemetry.tracer().start_as_current_span("admission.submit", kind=trace.SpanKind.SERVER,
                                                  attributes=attributes) as span:
        span.set_attributes({"sluice.tenant": "t", "sluice.tenant.name": "acme"})
        parent = telemetry.traceparent()
        span.set_attributes({"sluice.run_id": CLAIM.run_id, "gen_ai.usage.input_tokens": 512,
                             "sluice.deduplicated": False})
    metrics.submitted(time.perf_counter() - started)
    metrics.budget_left("acme", 1_000_000, 5_000_000)
    return parent


def run_once(metrics: RoutingMetrics, parent: str | None) -> None:
    claim = dataclasses.replace(CLAIM, traceparent=parent)
    tracer = telemetry.tracer()
    context = telemetry.context_of(parent)
    tracer.start_span("run.claim", context=context, attributes=claim_attributes(claim, DECISION)).end()
    with tracer.start_as_current_span("run.drive", context=context):
        with tracer.start_as_current_span(stream_span_name(claim), kind=trace.SpanKind.CLIENT,
                                          attributes=stream_attributes(claim, "127.0.0.1:18001")) as span:
            span.set_attributes(stream_end_attributes(claim, ENDING, 1, 0.12))
        with tracer.start_as_current_span("run.settle", attributes={"sluice.run_id": claim.run_id}):
            pass
    metrics.run_ended("tiny-chat-v1", 256, OUTCOME)


def per_call_us(body: Callable[[], object], n: int) -> float:
    for _ in range(min(n, 1_000)):
        body()
    # CPU time of the whole process (the exporter's thread included), not wall time: on a shared,
    # loaded box the wall clock mostly measures the other tenants.
    started = time.process_time()
    for _ in range(n):
        body()
    return (time.process_time() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20_000, help="runs timed per setup")
    args = parser.parse_args()
    sink = _Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    setups = {"none": TelemetrySettings(),
              "otlp, sampling 1.0": TelemetrySettings("otlp", endpoint, metrics_interval_s=0.1),
              "otlp, sampling 0.1": TelemetrySettings("otlp", endpoint, sampling=0.1, metrics_interval_s=0.1)}
    print(f"{'setup':<20} {'Submit CPU us':>14} {'run (worker) CPU us':>20}")
    try:
        for name, settings in setups.items():
            gateway, routing = GatewayMetrics(), RoutingMetrics()
            telemetry.setup_telemetry(settings, "bench", [gateway.registry, routing.registry])
            submit_us = per_call_us(functools.partial(submit_once, gateway), args.n)
            run_us = per_call_us(functools.partial(run_once, routing, submit_once(gateway)), args.n)
            telemetry.shutdown_tracing()
            print(f"{name:<20} {submit_us:>14.1f} {run_us:>20.1f}")
    finally:
        server.stop(None)
    print(f"spans the collector received: {sink.spans:,}")


if __name__ == "__main__":
    main()
