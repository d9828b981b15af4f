"""A run moves to another replica only before its first token; afterwards a failure interrupts it."""

from __future__ import annotations

import pytest

from sluice.router.policies import PrefixAware
from sluice.router.policy import ReplicaView, RouteRequest
from sluice.router.retry import FailureAction, after_replica_failure, retry_candidates


def test_a_run_without_tokens_is_retried_on_another_replica():
    assert after_replica_failure(tokens_streamed=0, attempts=1) is FailureAction.RETRY


def test_a_run_that_streamed_a_token_is_never_retried():
    assert after_replica_failure(tokens_streamed=1, attempts=1) is FailureAction.INTERRUPT
    assert after_replica_failure(tokens_streamed=500, attempts=1, max_attempts=10) is FailureAction.INTERRUPT


def test_retries_stop_when_attempts_are_spent_or_no_other_replica_is_left():
    assert after_replica_failure(tokens_streamed=0, attempts=2, max_attempts=2) is FailureAction.FAIL
    assert after_replica_failure(tokens_streamed=0, attempts=1, other_replicas_available=False) \
        is FailureAction.FAIL
    assert after_replica_failure(tokens_streamed=0, attempts=2, max_attempts=3) is FailureAction.RETRY


def test_a_failure_needs_an_attempt():
    with pytest.raises(AssertionError):
        after_replica_failure(tokens_streamed=0, attempts=0)


def test_a_retry_never_goes_back_to_a_replica_already_tried():
    views = [ReplicaView(name=name, pool="m", block_size=16, kv_capacity_blocks=10)
             for name in ("r0", "r1", "r2")]
    assert [v.name for v in retry_candidates(views, tried={"r0", "r2"})] == ["r1"]


def test_a_retry_releases_the_failed_attempt_and_lands_elsewhere_through_the_policy():
    policy = PrefixAware()
    views = [ReplicaView(name=name, pool="m", block_size=16, kv_capacity_blocks=1000)
             for name in ("r0", "r1")]
    request = RouteRequest(request_id="run-1", model_version="m", token_ids=tuple(range(300)),
                           max_output_tokens=8)
    first = policy.choose(request, views, 0.0)
    assert first is not None
    policy.on_routed(request, first, 0.0)
    # The replica fails before the first token: retry, releasing the failed attempt first.
    assert after_replica_failure(tokens_streamed=0, attempts=1) is FailureAction.RETRY
    policy.on_finished(request, first.replica, 1.0)
    second = policy.choose(request, retry_candidates(views, tried={first.replica}), 1.0)
    assert second is not None and second.replica != first.replica
    policy.on_routed(request, second, 1.0)
    assert policy.in_flight(first.replica) == 0 and policy.in_flight(second.replica) == 1
    # The second replica fails after streaming tokens: the run is interrupted, never retried.
    assert after_replica_failure(tokens_streamed=12, attempts=2, max_attempts=3) is FailureAction.INTERRUPT
