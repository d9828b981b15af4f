"""Prometheus registries pushed as OTLP metrics: the numbers a scrape would read, sent to a collector.

Sluice counts with prometheus_client (one set of metrics, one /metrics endpoint per process);
under [telemetry].exporter = "otlp" a daemon thread also converts what the registries hold into
OTLP data every interval and hands it to the OpenTelemetry OTLP metric exporter (grpc or
http/protobuf, with its retries). The conversion is pure (`metrics_data`):

    counter    sample <name>_total          -> Sum, cumulative, monotonic
    gauge      sample <name>                -> Gauge
    histogram  <name>_bucket{le} cumulative -> Histogram, cumulative; per-bucket counts are the
               <name>_count, <name>_sum        differences of the cumulative ones, bounds the finite le

Every process pushes its own numbers under its own resource (service.instance.id = pid), all
cumulative since the process started, so a collector adds up the processes of a host without
losing any: the OTLP side of the multiprocess question (telemetry.py's docstring has the scrape side).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as PrometheusMetric

log = logging.getLogger(__name__)

SCOPE = InstrumentationScope("sluice.prometheus")


def _labels(labels: dict[str, str], drop: str = "") -> dict[str, str]:
    return {key: value for key, value in labels.items() if key != drop}


def _counter(family: PrometheusMetric, start_ns: int, now_ns: int) -> Metric | None:
    points = [NumberDataPoint(attributes=_labels(sample.labels), start_time_unix_nano=start_ns,
                              time_unix_nano=now_ns, value=sample.value)
              for sample in family.samples if sample.name == family.name + "_total"]
    if not points:
        return None
    return Metric(name=family.name, description=family.documentation, unit=family.unit or None,
                  data=Sum(data_points=points, is_monotonic=True,
                           aggregation_temporality=AggregationTemporality.CUMULATIVE))


def _gauge(family: PrometheusMetric, now_ns: int) -> Metric | None:
    points = [NumberDataPoint(attributes=_labels(sample.labels), start_time_unix_nano=0,
                              time_unix_nano=now_ns, value=sample.value)
              for sample in family.samples if sample.name == family.name]
    if not points:
        return None
    return Metric(name=family.name, description=family.documentation, unit=family.unit or None,
                  data=Gauge(data_points=points))


@dataclass(slots=True)
class _Series:
    """One label set of a Prometheus histogram, as its samples arrive."""

    buckets: list[tuple[float, float]] = field(default_factory=list)   # (le, cumulative count)
    count: float = 0.0
    total: float = 0.0


def _histogram(family: PrometheusMetric, start_ns: int, now_ns: int) -> Metric | None:
    series: dict[tuple[tuple[str, str], ...], _Series] = {}
    for sample in family.samples:
        entry = series.setdefault(tuple(sorted(_labels(sample.labels, drop="le").items())), _Series())
        if sample.name == family.name + "_bucket":
            entry.buckets.append((float(sample.labels["le"]), sample.value))
        elif sample.name == family.name + "_count":
            entry.count = sample.value
        elif sample.name == family.name + "_sum":
            entry.total = sample.value
    points = []
    for key, entry in series.items():
        ordered = sorted(entry.buckets)
        cumulative = [count for _, count in ordered]
        counts = [int(count - previous) for previous, count in pairwise([0.0, *cumulative])]
        points.append(HistogramDataPoint(
            attributes=dict(key), start_time_unix_nano=start_ns, time_unix_nano=now_ns,
            count=int(entry.count), sum=entry.total, bucket_counts=counts,
            explicit_bounds=[bound for bound, _ in ordered if not math.isinf(bound)],
            min=None, max=None))     # type: ignore[arg-type]  # Prometheus keeps neither: left unset
    if not points:
        return None
    return Metric(name=family.name, description=family.documentation, unit=family.unit or None,
                  data=Histogram(data_points=points,
                                 aggregation_temporality=AggregationTemporality.CUMULATIVE))


def convert(families: Iterable[PrometheusMetric], start_ns: int, now_ns: int) -> list[Metric]:
    """OTLP metrics for Prometheus metric families (summaries, infos and the like are skipped)."""
    metrics: list[Metric | None] = []
    for family in families:
        if family.type == "counter":
            metrics.append(_counter(family, start_ns, now_ns))
        elif family.type == "gauge":
            metrics.append(_gauge(family, now_ns))
        elif family.type == "histogram":
            metrics.append(_histogram(family, start_ns, now_ns))
    return [metric for metric in metrics if metric is not None]


def metrics_data(registries: Sequence[CollectorRegistry], resource: Resource, start_ns: int,
                 now_ns: int) -> MetricsData:
    families = [family for registry in registries for family in registry.collect()]
    scope = ScopeMetrics(scope=SCOPE, metrics=convert(families, start_ns, now_ns), schema_url="")
    return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope],
                                                         schema_url="")])


def otlp_metric_exporter(endpoint: str, protocol: str) -> MetricExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc
        return Grpc(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http
    return Http(endpoint=endpoint.rstrip("/") + "/v1/metrics")


class MetricsPusher:
    """A daemon thread pushing the registries every `interval_s` (and once more at stop())."""

    def __init__(self, registries: Sequence[CollectorRegistry], exporter: MetricExporter,
                 resource: Resource, interval_s: float) -> None:
        self._registries = tuple(registries)
        self._exporter = exporter
        self._resource = resource
        self._interval_s = interval_s
        self._start_ns = time.time_ns()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="otlp-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def push(self) -> None:
        data = metrics_data(self._registries, self._resource, self._start_ns, time.time_ns())
        try:
            self._exporter.export(data, timeout_millis=5_000)
        except Exception:      # a collector that is down must not take the process with it
            log.warning("OTLP metrics push failed", exc_info=True)

    def _loop(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self.push()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self.push()
        self._exporter.shutdown()
