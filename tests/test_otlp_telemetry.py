"""Telemetry that leaves the process: one run is one trace across the gateway and routing worker
processes, exported over OTLP to a collector, with the GenAI semantic-convention attributes.

The collector is a tiny gRPC server in the test implementing opentelemetry-proto's TraceService
and MetricsService Export, keeping every request it receives. The gateway and the routing worker
are real processes (`python -m sluice.services.main --role gateway|routing`) with
[telemetry].exporter = "otlp"; the replica is a real Triton replica; PostgreSQL and Kafka are real.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from sluice.ledger.models import Run
from sluice.services import telemetry
from sluice.services.gateway_metrics import GatewayMetrics
from sluice.services.telemetry import TelemetrySettings
from sqlalchemy import select

from sluice.config.settings import env_overrides
from sluice.v1 import admission_pb2, admission_pb2_grpc, runs_pb2, runs_pb2_grpc
from tests.support import REPO_ROOT
from tests.support.ledger_factories import add_model, add_tenant
from tests.support.replica_proc import free_ports, start_replica, stop_replica
from tests.support.routing_stack import MODEL, REPLICA_SETTINGS, TOKENIZER, WORKER_READY

pytest_plugins = ["tests.support.db"]
pytestmark = pytest.mark.integration

GATEWAY_READY = "gateway (admission, runs, usage) listening on"
CAP = 6                       # output tokens: the replica streams exactly the cap ("cap" lengths)


# --- the in-memory collector ------------------------------------------------------------------


@dataclass
class Collector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    traces: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(default_factory=list)

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (both services)
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.traces.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self.metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) for every span received."""
        return [(attribute_of(resource_spans.resource.attributes, "service.name"), span)
                for request in self.traces for resource_spans in request.resource_spans
                for scope in resource_spans.scope_spans for span in scope.spans]


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def attribute_of(attributes: Any, key: str) -> Any:
    return next((value_of(item.value) for item in attributes if item.key == key), None)


def attributes(span: Any) -> dict[str, Any]:
    return {item.key: value_of(item.value) for item in span.attributes}


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"http://127.0.0.1:{port}"
    server.stop(None)


# --- the processes ----------------------------------------------------------------------------


@dataclass
class Process:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, marker: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.log():
            assert self.process.poll() is None, f"exited {self.process.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {marker!r}:\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM: the process drains and flushes its exporters on the way out."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def launch(role: str, env: dict[str, str], log_path: Path, *args: str) -> Process:
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "sluice.services.main", "--role", role, *args],
                                   cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Process(process, log_path)


def telemetry_env(dsn: str, endpoint: str, replica_address: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.update(env_overrides("database", {"dsn": dsn}))
    env.update(env_overrides("telemetry", {"exporter": "otlp", "endpoint": endpoint, "protocol": "grpc",
                                           "metrics_interval_ms": 500}))
    env.update(env_overrides("http", {"enabled": False}))
    env.update(env_overrides("gateway", {"metrics_port": 0}))
    env.update(env_overrides("routing", {"metrics_port": 0, "policy": "round_robin"}))
    env["SLUICE_REPLICAS"] = (f'[{{"name": "r0", "pool": "{MODEL.version}", '
                              f'"grpc_address": "{replica_address}"}}]')
    return env


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        process.stop()


async def test_one_run_is_one_trace_across_the_gateway_and_the_worker_exported_over_otlp(
        database_dsn, sessionmaker, collector, processes, tmp_path):
    sink, endpoint = collector
    async with sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, MODEL)
        tenant = await add_tenant(session, "acme")
    replica = start_replica("r0", tmp_path, REPLICA_SETTINGS)
    try:
        env = telemetry_env(database_dsn, endpoint, replica.grpc_address)
        address = f"127.0.0.1:{free_ports(1)[0]}"
        gateway = launch("gateway", env, tmp_path / "gateway.log", "--listen", address)
        worker = launch("routing", env, tmp_path / "routing.log", "--name", "otlp")
        processes.extend([gateway, worker])
        gateway.wait_for(GATEWAY_READY)
        worker.wait_for(WORKER_READY)

        async with grpc.aio.insecure_channel(address) as channel:
            submitted = await admission_pb2_grpc.AdmissionStub(channel).Submit(
                admission_pb2.SubmitRequest(model=MODEL.alias, input=b"hello there", max_output_tokens=CAP,
                                            request_key="traced"),
                metadata=(("x-api-key", tenant.api_key),))
            run = await wait_for_end(sessionmaker, submitted.run_id)
            streamed = [event async for event in runs_pb2_grpc.RunsStub(channel).Stream(
                runs_pb2.StreamRequest(run_id=submitted.run_id), metadata=(("x-api-key", tenant.api_key),))]
        assert run.status == "COMPLETED" and run.output_tokens == CAP
        for process in (gateway, worker):
            process.stop()            # flushes the batched spans and pushes the metrics once more
    finally:
        stop_replica(replica)

    spans = sink.spans()
    [(gateway_service, submit)] = [(service, span) for service, span in spans
                                   if span.name == "admission.submit"]
    trace_id = submit.trace_id
    # The run row keeps the Submit span's traceparent: version-traceid-spanid-flags (bit 0: sampled).
    version, stored_trace, stored_span, flags = run.traceparent.split("-")
    assert (version, stored_trace, stored_span) == ("00", trace_id.hex(), submit.span_id.hex())
    assert int(flags, 16) & 1
    in_trace = {span.name: (service, span) for service, span in spans if span.trace_id == trace_id}
    stream_name = f"text_completion {MODEL.version}"
    assert set(in_trace) == {"admission.submit", "run.claim", "run.drive", stream_name, "run.settle",
                             "runs.stream"}
    assert gateway_service == in_trace["runs.stream"][0] == "sluice-gateway"
    # The client's Stream call joins the run's trace from the traceparent on the run row.
    reader = in_trace["runs.stream"][1]
    assert reader.parent_span_id == submit.span_id
    assert attributes(reader)["sluice.last_sequence"] == streamed[-1].sequence
    assert {in_trace[name][0] for name in ("run.claim", "run.drive", stream_name, "run.settle")} == {
        "sluice-routing"}
    # The worker's spans hang under the Submit span; the stream and settlement under run.drive.
    drive = in_trace["run.drive"][1]
    assert in_trace["run.claim"][1].parent_span_id == drive.parent_span_id == submit.span_id
    stream_span, settle = in_trace[stream_name][1], in_trace["run.settle"][1]
    assert stream_span.parent_span_id == settle.parent_span_id == drive.span_id

    submit_attributes = attributes(submit)
    assert submit_attributes["gen_ai.request.model"] == MODEL.alias
    assert submit_attributes["gen_ai.request.max_tokens"] == CAP
    assert submit_attributes["gen_ai.usage.input_tokens"] == submitted.input_tokens
    assert submit_attributes["sluice.run_id"] == submitted.run_id
    assert submit_attributes["sluice.tenant"] == str(tenant.id)          # as on the worker's spans
    assert submit_attributes["sluice.tenant.name"] == "acme"
    stream = attributes(in_trace[stream_name][1])
    expected = {
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "sluice",
        "gen_ai.request.model": MODEL.version, "gen_ai.usage.input_tokens": submitted.input_tokens,
        "gen_ai.usage.output_tokens": CAP, "gen_ai.response.finish_reasons": ["length"],
        "sluice.run_id": submitted.run_id, "sluice.tenant": str(tenant.id)}
    assert {key: stream[key] for key in expected} == expected
    assert in_trace[stream_name][1].kind == in_trace[stream_name][1].SPAN_KIND_CLIENT

    # The gateway's metrics left the process too: one admitted Submit, timed.
    assert submit_count(sink, "sluice-gateway") == 1


async def wait_for_end(sessionmaker, run_id: str, timeout_s: float = 60.0) -> Run:
    deadline = time.monotonic() + timeout_s
    while True:
        async with sessionmaker() as session:
            run = await session.scalar(select(Run).where(Run.id == run_id))
        if run is not None and run.finished_at is not None:
            return run
        assert time.monotonic() < deadline, f"run {run_id} did not end: {run and run.status}"
        await asyncio.sleep(0.1)


def submit_count(sink: Collector, service: str) -> int:
    """sluice_submit_seconds{code="OK"}'s count in the last push from `service`."""
    counts = [point.count
              for request in sink.metrics for resource in request.resource_metrics
              if attribute_of(resource.resource.attributes, "service.name") == service
              for scope in resource.scope_metrics for metric in scope.metrics
              if metric.name == "sluice_submit_seconds"
              for point in metric.histogram.data_points
              if KeyValue(key="code", value=AnyValue(string_value="OK")) in point.attributes]
    assert counts, f"no sluice_submit_seconds from {service}"
    return counts[-1]


def test_http_protobuf_sends_spans_and_metrics_to_the_collectors_v1_paths():
    """[telemetry].protocol = "http/protobuf": POST <endpoint>/v1/traces and /v1/metrics, protobuf."""
    received: list[tuple[str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        metrics = GatewayMetrics()
        metrics.submitted(0.004)
        settings = TelemetrySettings("otlp", f"http://127.0.0.1:{server.server_address[1]}",
                                     protocol="http/protobuf", metrics_interval_s=60)
        telemetry.setup_telemetry(settings, "sluice-test", [metrics.registry])
        telemetry.tracer().start_span("admission.submit").end()
        telemetry.shutdown_tracing()        # flushes the span, pushes the metrics once more
    finally:
        server.shutdown()
    paths = {path for path, _ in received}
    assert paths == {"/v1/traces", "/v1/metrics"}
    [traces] = [body for path, body in received if path == "/v1/traces"]
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(traces)
    assert [span.name for resource in request.resource_spans for scope in resource.scope_spans
            for span in scope.spans] == ["admission.submit"]
    pushed = metrics_service_pb2.ExportMetricsServiceRequest.FromString(
        next(body for path, body in received if path == "/v1/metrics"))
    [histogram] = [metric.histogram for resource in pushed.resource_metrics
                   for scope in resource.scope_metrics for metric in scope.metrics
                   if metric.name == "sluice_submit_seconds"]
    [point] = histogram.data_points
    assert (point.count, point.sum) == (1, 0.004)
    # 0.004 s falls in the bucket (0.002, 0.005]: the per-bucket counts, not Prometheus' cumulative ones.
    assert list(point.bucket_counts) == [0, 0, 0, 1] + [0] * (len(point.explicit_bounds) - 3)
