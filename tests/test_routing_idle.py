"""What an idle routing process pays per second (issue 9): its scrapes slow down while it drives no
run, its health gauges are written when a verdict changes, and its timer loops take no task per
tick. A worker built without a database (nothing here reaches one) and stand-ins for the replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import pytest
from sluice.services.routing import worker as routing_worker
from sluice.services.routing.observability import RoutingMetrics
from sluice.services.routing.worker import IDLE_SCRAPE_S, RoutingWorker, WorkerSettings

from sluice.router.factory import make_policy_from_config
from sluice.router.registry import ReplicaRegistry, ReplicaSpec

SCRAPE_S = 0.25


class CountingMetrics(RoutingMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.health_writes: list[dict[str, bool]] = []

    def health(self, states: Mapping[str, bool]) -> None:
        self.health_writes.append(dict(states))
        super().health(states)


def idle_worker(metrics: RoutingMetrics | None = None) -> RoutingWorker:
    settings = WorkerSettings(owner="idle:1", lease_seconds=5.0, poll_interval_s=0.05, max_runs=8,
                              coalesce_ms=200, first_token_timeout_s=30.0, scrape_interval_s=SCRAPE_S)
    registry = ReplicaRegistry([ReplicaSpec(name, "m", f"127.0.0.1:{port}", metrics_url=f"http://127.0.0.1:{port}/")
                                for name, port in (("r0", 1), ("r1", 2))])
    return RoutingWorker(settings, None, None, make_policy_from_config({"policy": "least_loaded"}),  # type: ignore[arg-type]
                         registry, dsn="postgresql://nobody@127.0.0.1:1/none", metrics=metrics)


def test_an_idle_process_scrapes_every_idle_interval_and_one_driving_a_run_at_the_configured_one():
    worker = idle_worker()
    assert worker._scrape_interval() == IDLE_SCRAPE_S > SCRAPE_S
    worker.drivers["run-1"] = object()  # type: ignore[assignment]
    assert worker._scrape_interval() == SCRAPE_S


async def test_health_gauges_are_written_once_per_verdict_not_per_check(monkeypatch: pytest.MonkeyPatch):
    metrics = CountingMetrics()
    worker = idle_worker(metrics)
    ready = {"127.0.0.1:1": True, "127.0.0.1:2": True}

    async def is_ready(address: str, timeout_s: float = 2.0) -> bool:
        return ready[address]

    monkeypatch.setattr(routing_worker.replica_client, "is_ready", is_ready)
    for _ in range(3):
        await worker.check_health_once()
    assert metrics.health_writes == [{"r0": True, "r1": True}]
    # Two failures in a row open r1's breaker (HEALTH's failure_threshold): one write, with the verdict.
    now = time.time()
    worker.health.record_failure("r1", now)
    worker.health.record_failure("r1", now)
    for _ in range(3):
        await worker.check_health_once()
    assert metrics.health_writes == [{"r0": True, "r1": True}, {"r0": True, "r1": False}]
    assert metrics.registry.get_sample_value("sluice_replica_healthy", {"replica": "r1"}) == 0.0


async def test_a_timer_loop_ends_at_its_next_tick_once_told_to_stop_and_makes_no_task_per_tick():
    worker = idle_worker()
    stop = asyncio.Event()
    steps: list[int] = []
    tasks_seen: list[int] = []

    async def step() -> bool:
        steps.append(1)
        tasks_seen.append(len(asyncio.all_tasks()))
        if len(steps) == 5:
            stop.set()
        return False

    await asyncio.wait_for(worker._every(step, 0.01, until=stop), 2.0)
    assert len(steps) == 5
    assert len(set(tasks_seen)) == 1          # the same tasks at every tick: none made per tick
