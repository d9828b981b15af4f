"""Circuit breakers and active-check scheduling; an unhealthy replica gets no runs until it recovers."""

from __future__ import annotations

from dataclasses import replace

from sluice.router.factory import make_policy
from sluice.router.health import BreakerState, CircuitBreaker, HealthBook, HealthOptions
from sluice.router.policy import RouteRequest
from sluice.router.registry import ReplicaRegistry, ReplicaSpec

OPTIONS = HealthOptions(failure_threshold=3, open_s=5.0, check_interval_s=2.0, probe_interval_s=1.0)


def test_a_breaker_opens_after_the_threshold_of_consecutive_failures():
    breaker = CircuitBreaker(OPTIONS)
    breaker.record_failure(0.0)
    breaker.record_failure(0.1)
    assert breaker.state(0.2) is BreakerState.CLOSED
    breaker.record_failure(0.2)
    assert breaker.state(0.2) is BreakerState.OPEN
    assert not breaker.allows_routing(0.2)


def test_a_success_resets_the_failure_count():
    breaker = CircuitBreaker(OPTIONS)
    breaker.record_failure(0.0)
    breaker.record_failure(0.1)
    breaker.record_success(0.2)
    breaker.record_failure(0.3)
    breaker.record_failure(0.4)
    assert breaker.state(0.4) is BreakerState.CLOSED
    assert breaker.consecutive_failures == 2


def test_an_open_breaker_turns_half_open_after_its_rest_and_allows_one_trial():
    breaker = CircuitBreaker(OPTIONS)
    for t in (0.0, 0.1, 0.2):
        breaker.record_failure(t)
    assert breaker.state(5.1) is BreakerState.OPEN
    assert breaker.state(5.2) is BreakerState.HALF_OPEN
    assert breaker.allow_trial(5.2) and not breaker.allows_routing(5.2)


def test_a_failed_trial_reopens_for_another_rest_and_a_good_one_closes():
    breaker = CircuitBreaker(OPTIONS)
    for t in (0.0, 0.1, 0.2):
        breaker.record_failure(t)
    breaker.record_failure(6.0)                                     # half-open trial fails
    assert breaker.state(10.9) is BreakerState.OPEN
    assert breaker.state(11.0) is BreakerState.HALF_OPEN
    breaker.record_success(11.0)
    assert breaker.state(11.0) is BreakerState.CLOSED


def test_checks_are_due_at_once_then_every_interval_and_faster_while_open():
    book = HealthBook(OPTIONS)
    book.sync(["r1", "r0"], now=0.0)
    assert book.due_checks(0.0) == ["r0", "r1"]
    book.record_success("r0", 0.0)
    for t in (0.0, 0.1, 0.2):
        book.record_failure("r1", t)
    assert book.due_checks(1.0) == []
    assert book.due_checks(1.2) == ["r1"]                           # open: probe every 1 s
    assert book.due_checks(2.0) == ["r0", "r1"]                     # closed: every 2 s
    assert book.next_due() == 1.2


def test_sync_forgets_removed_replicas_and_an_unknown_replica_is_not_healthy():
    book = HealthBook(OPTIONS)
    book.sync(["r0", "r1"], now=0.0)
    book.sync(["r1"], now=1.0)
    assert not book.is_healthy("r0", 1.0)
    assert book.is_healthy("r1", 1.0)


def test_an_unhealthy_replica_gets_no_runs_and_comes_back_when_healthy():
    registry = ReplicaRegistry([ReplicaSpec(name=f"r{i}", pool="m", grpc_address=f"h:{i}") for i in range(3)])
    health = HealthBook(OPTIONS)
    health.sync([spec.name for spec in registry.specs()], now=0.0)
    for t in (0.0, 0.1, 0.2):
        health.record_failure("r1", t)
    for name in ("round_robin", "least_loaded", "prefix_aware"):
        policy = make_policy(name)
        chosen = set()
        for n in range(30):
            req = RouteRequest(request_id=f"{name}{n}", model_version="m", token_ids=[n] * 40,
                               max_output_tokens=8)
            decision = policy.choose(req, registry.views("m", 1.0 + n * 0.1, health), 1.0 + n * 0.1)
            assert decision is not None
            policy.on_routed(req, decision, 1.0)
            chosen.add(decision.replica)
        assert chosen == {"r0", "r2"}, name
    # The rest ends, the active probe succeeds: r1 is back in rotation.
    assert "r1" in health.due_checks(5.2)
    health.record_success("r1", 5.2)
    views = registry.views("m", 5.3, health)
    assert [v.name for v in views] == ["r0", "r1", "r2"]
    policy = make_policy("least_loaded")
    req = RouteRequest(request_id="back", model_version="m", token_ids=[1] * 40, max_output_tokens=8)
    loaded = [v if v.name == "r1" else replace(v, running=5) for v in views]
    decision = policy.choose(req, loaded, 5.3)
    assert decision is not None and decision.replica == "r1"
