"""Both hosts run the very same policy object: the live routing service and the fleet simulator."""

from __future__ import annotations

import pytest
from sluice.services.routing.app import build_worker
from sluice.services.routing.worker import RoutingWorker

from sluice.config import load_settings
from sluice.router.factory import make_policy
from sluice.router.policies import LeastLoaded, PrefixAware
from sluice.router.policy import RoundRobin, RouteRequest
from sluice.sim.fleet import Fleet, FleetConfig
from sluice.sim.workload import WorkloadConfig

POLICY_CLASSES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware}


def live_worker(policy: str) -> RoutingWorker:
    """The routing service's worker as its process assembles it (building it opens no connection)."""
    config = load_settings(environ={"SLUICE_ROUTING__POLICY": policy})
    return build_worker(config, events=None, sessions=None, owner="test")


def tiny_fleet() -> Fleet:
    return Fleet(FleetConfig(replicas=2), WorkloadConfig(duration_s=20.0, users=40, think_time_s=2.0,
                                                         system_prompt_tokens=64))


@pytest.mark.parametrize("name", sorted(POLICY_CLASSES))
def test_the_routing_service_builds_its_policy_with_the_shared_factory(name: str):
    worker = live_worker(name)
    assert type(worker.policy) is POLICY_CLASSES[name]
    assert type(worker.policy) is type(make_policy(name))


@pytest.mark.parametrize("name", sorted(POLICY_CLASSES))
def test_the_live_service_policy_object_runs_unchanged_in_the_simulator(name: str):
    worker = live_worker(name)
    fleet = tiny_fleet()
    report = fleet.run(worker.policy)                               # the very object the service holds
    assert report.policy == name
    assert report.requests_completed > 0
    assert sum(count for _, count in report.routing_outcomes) >= report.requests_completed


def test_the_live_service_decides_over_its_configured_replicas_through_the_policy():
    worker = live_worker("prefix_aware")
    pool = "smollm2-135m-instruct"                 # the shipped config's replicas
    request = RouteRequest(request_id="explain-1", model_version=pool, token_ids=tuple(range(100)),
                           max_output_tokens=8, conversation_id="c1")
    decision = worker.explain(request, pool)
    assert decision is not None and decision.replica in {"r0", "r1"}
