"""Both hosts run the very same policy object: the live routing service and the fleet simulator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sluice.services.routing.app import build_worker
from sluice.services.routing.worker import RoutingWorker

from sluice.config import load_settings
from sluice.router.factory import make_policy
from sluice.router.policies import LeastLoaded, PrefixAware
from sluice.router.policy import RoundRobin, RouteDecision, RouteRequest
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


def test_the_live_service_tells_the_policy_how_many_tokens_a_finished_run_streamed():
    """The routing worker passes the run's durable output tokens to on_finished, which a conversation's
    next turn sends back as history (the policy credits its home with them)."""
    worker = live_worker("prefix_aware")
    heard: list[tuple[str, str, int]] = []

    class Listening(PrefixAware):
        def on_finished(self, request: RouteRequest, replica: str, now: float,
                        output_tokens: int = 0) -> None:
            heard.append((request.request_id, replica, output_tokens))

    worker.policy = Listening()
    request = RouteRequest(request_id="run-1", model_version="m", token_ids=tuple(range(10)),
                           max_output_tokens=8, conversation_id="c1")
    worker._requests["run-1"] = SimpleNamespace(request=request, decision=RouteDecision("r0", "affinity_hit"))
    driver = SimpleNamespace(output_tokens=37, outcome=None)
    done = SimpleNamespace(cancelled=lambda: False, exception=lambda: None, result=lambda: None)
    worker._driver_done("run-1", driver, done)        # type: ignore[arg-type]
    assert heard == [("run-1", "r0", 37)]
