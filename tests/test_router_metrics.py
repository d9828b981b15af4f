"""Router metrics: decisions per policy outcome and predicted against reported cache hits."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sluice.router.metrics import RouterMetrics, RouterMetricsSnapshot
from sluice.router.policy import RouteDecision


def test_decisions_are_counted_per_policy_and_outcome_with_predicted_tokens():
    metrics = RouterMetrics()
    metrics.record_decision("prefix_aware", RouteDecision("r0", "affinity_hit", predicted_cached_tokens=64))
    metrics.record_decision("prefix_aware", RouteDecision("r1", "affinity_hit", predicted_cached_tokens=32))
    metrics.record_decision("prefix_aware", RouteDecision("r1", "fallback"))
    snapshot = metrics.snapshot()
    assert snapshot.decisions == {("prefix_aware", "affinity_hit"): 2, ("prefix_aware", "fallback"): 1}
    assert snapshot.predicted_cached_tokens == 96
    assert snapshot.outcome_share("prefix_aware", "fallback") == 1 / 3


def test_reported_cache_hits_are_compared_with_predictions():
    metrics = RouterMetrics()
    metrics.record_reported(predicted_cached_tokens=64, reported_cached_tokens=48, prompt_tokens=100)
    metrics.record_reported(predicted_cached_tokens=0, reported_cached_tokens=16, prompt_tokens=100)
    assert metrics.snapshot() == RouterMetricsSnapshot(reported_cached_tokens=64, prompt_tokens=200,
                                                       reported_runs=2, overpredicted_runs=1)
    assert metrics.snapshot().reported_hit_rate == 0.32


def test_counters_are_exported_to_a_prometheus_registry_when_given_one():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    metrics.record_decision("least_loaded", RouteDecision("r0", "least_loaded"))
    metrics.record_reported(predicted_cached_tokens=0, reported_cached_tokens=16, prompt_tokens=40)
    assert registry.get_sample_value("sluice_router_decisions_total",
                                     {"policy": "least_loaded", "outcome": "least_loaded"}) == 1.0
    assert registry.get_sample_value("sluice_router_cached_tokens_total", {"kind": "reported"}) == 16.0
