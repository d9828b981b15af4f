"""The routing process's telemetry without servers: exporter choice, spans kept in memory,
and what one run's outcome adds to the Prometheus registry."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from prometheus_client.metrics import MetricWrapperBase
from sluice.ledger.models import RunStatus
from sluice.services import telemetry
from sluice.services.routing.observability import RoutingMetrics, RunOutcome, ServiceObjectives
from sluice.services.telemetry import UNKNOWN_EXPORTER, TelemetrySettings

from sluice.config import Settings
from sluice.router.load import LoadSnapshot
from sluice.router.policy import RouteDecision

POOL = "tiny-chat-v1"


def outcome(status: RunStatus = RunStatus.COMPLETED, *, input_tokens: int = 100, cached: int = 64,
            reported: int = 64, ttft_s: float | None = 0.3, tpot_s: float | None = 0.02) -> RunOutcome:
    return RunOutcome(status=status, replica="r0", attempts=1, input_tokens=input_tokens, output_tokens=10,
                      cached_input_tokens=cached, reported_cached_tokens=reported, ttft_s=ttft_s,
                      tpot_s=tpot_s)


@pytest.fixture
def reset_tracing() -> Iterator[None]:
    yield
    telemetry.shutdown_tracing()


def test_an_unknown_exporter_is_refused_with_the_ones_known():
    with pytest.raises(ValueError) as caught:
        TelemetrySettings(exporter="jaeger")
    assert str(caught.value) == UNKNOWN_EXPORTER.format(value="jaeger")


def test_without_a_telemetry_section_tracing_is_off_and_costs_a_no_op_tracer(reset_tracing: None):
    telemetry.setup_tracing(TelemetrySettings.from_config(Settings()), "test")
    assert isinstance(telemetry.tracer(), trace.NoOpTracer)
    with telemetry.tracer().start_as_current_span("run.drive"):
        pass
    assert telemetry.finished_spans() == ()


def test_the_memory_exporter_keeps_each_ended_span_with_its_attributes(reset_tracing: None):
    telemetry.setup_tracing(TelemetrySettings(exporter="memory"), "test")
    with telemetry.tracer().start_as_current_span("run.drive", attributes={"sluice.run_id": "r-1"}) as span:
        span.set_attribute("sluice.status", "COMPLETED")
    telemetry.tracer().start_span("run.claim").end()
    [drive] = telemetry.finished_spans("run.drive")
    assert dict(drive.attributes or {}) == {"sluice.run_id": "r-1", "sluice.status": "COMPLETED"}
    assert [span.name for span in telemetry.finished_spans()] == ["run.drive", "run.claim"]


def test_setting_up_again_replaces_the_exporter(reset_tracing: None):
    telemetry.setup_tracing(TelemetrySettings(exporter="memory"), "test")
    telemetry.tracer().start_span("run.claim").end()
    telemetry.setup_tracing(TelemetrySettings(exporter="memory"), "test")
    assert telemetry.finished_spans() == ()


def test_a_completed_run_within_both_objectives_counts_as_goodput_with_its_ttft_and_tpot():
    metrics = RoutingMetrics(objectives=ServiceObjectives(ttft_s=0.5, tpot_s=0.05))
    metrics.run_ended(POOL, 64, outcome())
    metrics.run_ended(POOL, 0, outcome(ttft_s=0.8))                       # TTFT missed
    value = metrics.registry.get_sample_value
    assert value("sluice_runs_total", {"pool": POOL, "status": "COMPLETED"}) == 2.0
    assert value("sluice_run_goodput_total", {"pool": POOL}) == 1.0
    assert value("sluice_run_ttft_seconds_count", {"pool": POOL}) == 2.0
    assert value("sluice_run_ttft_seconds_bucket", {"pool": POOL, "le": "0.35"}) == 1.0
    assert value("sluice_run_tpot_seconds_sum", {"pool": POOL}) == pytest.approx(0.04)
    assert value("sluice_run_tokens_total", {"pool": POOL, "kind": "cached_input"}) == 128.0


def test_a_run_no_replica_took_is_counted_but_not_reported_as_a_cache_miss():
    metrics = RoutingMetrics()
    metrics.run_ended(POOL, 64, outcome(RunStatus.FAILED, input_tokens=0, cached=0, reported=0,
                                        ttft_s=None, tpot_s=None))
    snapshot = metrics.router.snapshot()
    assert (snapshot.reported_runs, snapshot.prompt_tokens) == (0, 0)
    value = metrics.registry.get_sample_value
    assert value("sluice_runs_total", {"pool": POOL, "status": "FAILED"}) == 1.0
    assert value("sluice_run_ttft_seconds_count", {"pool": POOL}) is None


def test_decisions_are_counted_by_policy_and_outcome_and_timed():
    metrics = RoutingMetrics()
    metrics.decided("prefix_aware", RouteDecision("r0", "affinity_hit", predicted_cached_tokens=96), 80e-6)
    value = metrics.registry.get_sample_value
    labels = {"policy": "prefix_aware", "outcome": "affinity_hit"}
    assert value("sluice_router_decisions_total", labels) == 1.0
    assert value("sluice_router_cached_tokens_total", {"kind": "predicted"}) == 96.0
    assert value("sluice_router_decision_seconds_bucket", {"le": "0.0001"}) == 1.0


def test_objectives_come_from_the_telemetry_section_in_milliseconds():
    tighter = Settings().updated(telemetry={"ttft_slo_ms": 200, "tpot_slo_ms": 40})
    assert ServiceObjectives.from_config(tighter) == ServiceObjectives(ttft_s=0.2, tpot_s=0.04)
    assert ServiceObjectives.from_config(Settings()) == ServiceObjectives(ttft_s=0.5, tpot_s=0.05)


def test_a_scrape_sets_each_load_gauge_of_its_replica_and_forgetting_the_replica_removes_them():
    metrics = RoutingMetrics()
    snapshot = LoadSnapshot(active=3, waiting=2, scheduled=1, kv_used_blocks=40, kv_fraction=0.25)
    metrics.health({"r0": True})
    metrics.scraped("r0", snapshot, 0.002, restarted=False)
    value = metrics.registry.get_sample_value
    assert {kind: value("sluice_replica_load", {"replica": "r0", "kind": kind}) for kind in
            ("active", "waiting", "scheduled", "kv_used_blocks", "kv_fraction")} == {
        "active": 3.0, "waiting": 2.0, "scheduled": 1.0, "kv_used_blocks": 40.0, "kv_fraction": 0.25}
    metrics.forget_replica("r0")
    metrics.forget_replica("r0")   # twice: nothing left to remove is no error
    assert value("sluice_replica_healthy", {"replica": "r0"}) is None
    assert value("sluice_replica_load", {"replica": "r0", "kind": "active"}) is None


def test_the_series_a_run_ends_on_are_looked_up_once_per_pool(monkeypatch: pytest.MonkeyPatch):
    metrics = RoutingMetrics()
    looked_up: list[dict[str, str]] = []
    labels = MetricWrapperBase.labels

    def counted(self, *values, **named):  # type: ignore[no-untyped-def]
        if "pool" in named:                  # (the router's own metrics are by kind alone)
            looked_up.append(named)
        return labels(self, *values, **named)

    monkeypatch.setattr(MetricWrapperBase, "labels", counted)
    metrics.run_ended(POOL, 0, outcome())
    first = len(looked_up)
    metrics.run_ended(POOL, 0, outcome())
    metrics.run_ended("another-pool", 0, outcome())
    assert len(looked_up) == 2 * first and all(named["pool"] == "another-pool" for named in looked_up[first:])
    value = metrics.registry.get_sample_value
    assert value("sluice_runs_total", {"pool": POOL, "status": "COMPLETED"}) == 2.0
    assert value("sluice_run_tokens_total", {"pool": POOL, "kind": "output"}) == 2 * outcome().output_tokens
