"""The router wired into the live routing service, on real replicas: health from scrapes and
readiness checks, retry before the first token, prefix-aware affinity with the core engine's
prefix cache, restart detection by scraping, and the routing process's metrics and spans."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sluice.ledger.models import RunStatus, UsageEntry
from sluice.services import telemetry
from sluice.services.admission_rules import ENGINE_DEFAULT, Sampling
from sluice.services.replica_client import TokenChunk
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.driver import TRITON
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice.services.telemetry import TelemetrySettings
from sluice_client.sdk import SluiceClient
from sqlalchemy import select

from sluice.router.policies import PrefixAware
from sluice.router.retry import NO_REPLICA_STARTED
from sluice.v1 import common_pb2, runs_pb2
from tests.support.ledger_factories import budget_row
from tests.support.replica_proc import (
    ReplicaProcess,
    free_ports,
    kill_replica,
    launch_replica,
    start_replica,
    stop_replica,
    wait_ready,
)
from tests.support.routing_stack import MODEL, REPLICA_SETTINGS, Stack, collect, deltas_tokens, replica_tables

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."
# The core engine (engine/ inflight batcher, prefix reuse by 32-token blocks) in real time.
CORE_SETTINGS = {"engine": "core", "output_length": "cap"}
HISTORY = " ".join(f"Gate {i} of the old canal lifts {i % 7} boats an hour in the dry season."
                   for i in range(30))


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s}s")
        await asyncio.sleep(0.05)


def healthy(worker: RoutingWorker, name: str) -> bool:
    return worker.health.is_healthy(name, time.time())


def refusing_replica(name: str) -> dict[str, object]:
    """A registry entry whose gRPC port nobody listens on (connection refused), not scraped."""
    return {"name": name, "pool": MODEL.version, "grpc_address": f"127.0.0.1:{free_ports(1)[0]}"}


async def usage_entries(stack: Stack, run_id: str) -> list[UsageEntry]:
    async with stack.sessionmaker() as session:
        return list((await session.scalars(
            select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id)))).all())


async def run_to_end(sdk: SluiceClient, prompt: str, max_output_tokens: int = 20,
                     conversation_id: str = "") -> tuple[str, list[runs_pb2.RunEvent]]:
    run = await sdk.submit(prompt, max_output_tokens=max_output_tokens, conversation_id=conversation_id)
    return run.run_id, await collect(sdk.stream(run.run_id))


@pytest.fixture(scope="module")
def core_replicas(replica_logs: Path) -> Iterator[list[ReplicaProcess]]:
    """Two replicas of the core engine (the `stack` fixture's pin to the simple engine stays)."""
    started: list[ReplicaProcess] = []
    try:
        for name in ("c0", "c1"):
            started.append(start_replica(name, replica_logs, CORE_SETTINGS))
        yield started
    finally:
        for replica in started:
            stop_replica(replica)


@pytest.fixture
def memory_spans() -> Iterator[None]:
    telemetry.setup_tracing(TelemetrySettings(exporter="memory"), "sluice-routing-test")
    try:
        yield
    finally:
        telemetry.shutdown_tracing()


# --- health -------------------------------------------------------------------------------------


async def test_a_killed_replica_gets_no_runs_while_its_breaker_is_open_and_runs_again_once_back(
        stack: Stack, replicas: list[ReplicaProcess], replica_logs: Path):
    doomed = await asyncio.to_thread(start_replica, "a-doomed", replica_logs, REPLICA_SETTINGS)
    ports = (int(doomed.grpc_address.rpartition(":")[2]), doomed.http_port, doomed.metrics_port)
    back: ReplicaProcess | None = None
    try:
        stack.config = stack.config.updated(replicas=replica_tables([doomed, replicas[0]]))
        worker = await stack.start_worker()
        await wait_until(lambda: worker.loads.snapshot("a-doomed") is not None, "scraped")
        await asyncio.to_thread(kill_replica, doomed)
        await wait_until(lambda: not healthy(worker, "a-doomed"), "marked unhealthy", timeout_s=5.0)
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            while_down = [await run_to_end(sdk, f"{PROMPT} {i}", 5) for i in range(4)]
            for run_id, events in while_down:
                assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
                assert (await stack.run_row(run_id)).replica == replicas[0].name

            back = await asyncio.to_thread(launch_replica, "a-doomed", replica_logs, REPLICA_SETTINGS, ports)
            await asyncio.to_thread(wait_ready, back)
            await wait_until(lambda: healthy(worker, "a-doomed"), "healthy again")
            after = [await run_to_end(sdk, f"{PROMPT} again {i}", 5) for i in range(4)]
        served_after = {(await stack.run_row(run_id)).replica for run_id, _ in after}
        assert served_after == {"a-doomed", replicas[0].name}
        assert all(events[-1].status == common_pb2.RUN_STATUS_COMPLETED for _, events in after)
    finally:
        await asyncio.to_thread(kill_replica, doomed)
        if back is not None:
            await asyncio.to_thread(stop_replica, back)


# --- retry before the first token -----------------------------------------------------------


async def test_a_run_whose_replica_refuses_before_the_first_token_completes_on_the_other_and_is_charged_once(
        stack: Stack, replicas: list[ReplicaProcess]):
    # round_robin takes names in order, so the first run goes to the refusing "a-refuses"; its breaker
    # needs two failed readiness checks a second apart, so the claim gets there first.
    stack.config = stack.config.updated(
        replicas=[refusing_replica("a-refuses"), *replica_tables(replicas[:1])])
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=30)
        worker = await stack.start_worker()
        events = await collect(sdk.stream(run.run_id))
    terminal = events[-1]
    assert terminal.status == common_pb2.RUN_STATUS_COMPLETED
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    row = await stack.wait_for_published(run.run_id)
    assert row.replica == replicas[0].name
    entries = await usage_entries(stack, run.run_id)
    assert [(e.input_tokens, e.output_tokens) for e in entries] == [(run.input_tokens, 30)]
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (0, run.input_tokens + 30)
    decisions = worker.metrics.router.snapshot().decisions
    assert sum(decisions.values()) == 2                   # the first choice and the retry's


class SilentAt:
    """Triton everywhere but at `address`, which takes requests and never answers until stopped."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.stopped: list[str] = []
        self._stops: dict[str, asyncio.Event] = {}

    async def generate(self, address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                       end_id: int | None = None, *, cache_salt: int = 0, sampling: Sampling = ENGINE_DEFAULT,
                       on_chunk: Callable[[TokenChunk], None]) -> None:
        if address != self.address:
            await TRITON.generate(address, request_id, prompt_ids, max_new_tokens, end_id,
                                  cache_salt=cache_salt, sampling=sampling, on_chunk=on_chunk)
            return
        await self._stops.setdefault(request_id, asyncio.Event()).wait()

    async def stop(self, address: str, request_id: str) -> None:
        if address != self.address:
            await TRITON.stop(address, request_id)
            return
        self.stopped.append(request_id)
        self._stops.setdefault(request_id, asyncio.Event()).set()


async def test_a_run_without_a_first_token_in_time_is_stopped_and_retried_elsewhere_its_prompt_charged_once(
        stack: Stack, replicas: list[ReplicaProcess]):
    # "a-slow" is a live replica (its readiness checks pass) whose answers never come.
    slow = {**replica_tables(replicas[1:2])[0], "name": "a-slow"}
    stack.config = stack.config.updated(replicas=[slow, *replica_tables(replicas[:1])])
    stack.config = stack.config.updated(routing={"first_token_timeout_s": 0.5})
    replica_client = SilentAt(str(slow["grpc_address"]))
    worker = RoutingWorker(WorkerSettings.from_config(stack.config, new_owner_id("test")), stack.sessionmaker,
                           stack.events, policy_from_config(stack.config),
                           registry_from_config(stack.config), replicas=replica_client)
    serving = asyncio.create_task(worker.serve(drain_s=0.5))
    try:
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            run = await sdk.submit(PROMPT, max_output_tokens=20)
            events = await collect(sdk.stream(run.run_id))
    finally:
        worker.stop()
        await serving
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED and deltas_tokens(events) == 20
    assert replica_client.stopped == [run.run_id]
    assert (await stack.run_row(run.run_id)).replica == replicas[0].name
    entries = await usage_entries(stack, run.run_id)
    assert [(e.input_tokens, e.output_tokens) for e in entries] == [(run.input_tokens, 20)]
    assert worker.health.breaker("a-slow").consecutive_failures == 1


async def test_a_run_no_replica_takes_ends_failed_with_nothing_charged(stack: Stack):
    stack.config = stack.config.updated(
        replicas=[refusing_replica("a-refuses"), refusing_replica("b-refuses")])
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=30)
        await stack.start_worker()
        events = await collect(sdk.stream(run.run_id))
    terminal = events[-1]
    assert terminal.status == common_pb2.RUN_STATUS_FAILED
    assert terminal.detail.startswith(NO_REPLICA_STARTED.format(attempts=2))
    usage = terminal.usage
    assert (usage.input_tokens, usage.output_tokens, usage.cost_micros) == (0, 0, 0)
    assert (await stack.run_row(run.run_id)).status == RunStatus.FAILED
    entries = await usage_entries(stack, run.run_id)
    assert [(e.input_tokens, e.output_tokens) for e in entries] == [(0, 0)]
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (0, 0)


# --- prefix affinity on the core engine -----------------------------------------------------


async def test_prefix_aware_sends_a_follow_up_turn_to_the_replica_holding_its_history_which_reuses_it(
        stack: Stack, core_replicas: list[ReplicaProcess], memory_spans: None):
    stack.config = stack.config.updated(replicas=replica_tables(core_replicas))
    stack.config = stack.config.updated(routing={"policy": "prefix_aware"})
    worker = await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        first_id, first = await run_to_end(sdk, HISTORY, 16, conversation_id="conv-1")
        follow_id, follow = await run_to_end(sdk, HISTORY + " And what of gate 31?", 16,
                                             conversation_id="conv-1")
    assert first[-1].status == follow[-1].status == common_pb2.RUN_STATUS_COMPLETED
    first_row, follow_row = await stack.run_row(first_id), await stack.run_row(follow_id)
    assert follow_row.replica == first_row.replica
    assert first_row.cached_input_tokens == 0
    assert follow_row.cached_input_tokens > 0
    assert follow[-1].usage.cached_input_tokens == follow_row.cached_input_tokens
    snapshot = worker.metrics.router.snapshot()
    assert snapshot.decisions.get(("prefix_aware", "affinity_hit")) == 1
    assert snapshot.reported_cached_tokens == follow_row.cached_input_tokens
    # The follow-up's run.drive span carries the decision and the outcome.
    spans = {span.attributes["sluice.run_id"]: span for span in telemetry.finished_spans("run.drive")}
    attributes = spans[follow_id].attributes
    assert attributes["sluice.route.outcome"] == "affinity_hit"
    assert attributes["sluice.route.predicted_cached_tokens"] > 0
    assert attributes["sluice.cached_input_tokens"] == follow_row.cached_input_tokens
    assert attributes["sluice.output_tokens"] == 16 and attributes["sluice.status"] == "COMPLETED"
    assert attributes["sluice.ttft_ms"] > 0 and attributes["sluice.tpot_ms"] > 0
    assert telemetry.finished_spans("run.claim")
    streams = {span.attributes["sluice.run_id"]: span.attributes
               for span in telemetry.finished_spans("runs.stream")}
    assert streams[follow_id]["sluice.last_sequence"] == follow[-1].sequence


# --- restart detection ----------------------------------------------------------------------


async def test_a_replica_restart_seen_by_scraping_makes_the_policy_forget_its_prefixes(
        stack: Stack, replica_logs: Path):
    replica = await asyncio.to_thread(start_replica, "r7", replica_logs, REPLICA_SETTINGS)
    ports = (int(replica.grpc_address.rpartition(":")[2]), replica.http_port, replica.metrics_port)
    again: ReplicaProcess | None = None
    try:
        stack.config = stack.config.updated(replicas=replica_tables([replica]))
        stack.config = stack.config.updated(routing={"policy": "prefix_aware"})
        worker = await stack.start_worker()
        policy = worker.policy
        assert isinstance(policy, PrefixAware)
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            await run_to_end(sdk, HISTORY, 5)
        assert policy.index.entries("r7") > 0
        await asyncio.to_thread(stop_replica, replica)
        again = await asyncio.to_thread(launch_replica, "r7", replica_logs, REPLICA_SETTINGS, ports)
        await asyncio.to_thread(wait_ready, again)
        await wait_until(lambda: policy.index.entries("r7") == 0, "forgotten", timeout_s=10.0)
        registry = worker.metrics.registry
        assert registry.get_sample_value("sluice_replica_restarts_total", {"replica": "r7"}) == 1.0
    finally:
        await asyncio.to_thread(stop_replica, replica)
        if again is not None:
            await asyncio.to_thread(stop_replica, again)


# --- the routing process's metrics endpoint -------------------------------------------------


async def test_the_routing_metrics_endpoint_exposes_the_ttft_histogram_after_a_run(stack: Stack):
    worker = await stack.start_worker()
    port = free_ports(1)[0]
    assert telemetry.serve_metrics(worker.metrics.registry, port)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_id, events = await run_to_end(sdk, PROMPT, 10)
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
    await wait_until(lambda: not worker.drivers, "driver done", timeout_s=5.0)
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as response:
        samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                   for family in text_string_to_metric_families(await response.text())
                   for sample in family.samples}
    pool = (("pool", MODEL.version),)
    assert samples[("sluice_run_ttft_seconds_count", pool)] == 1.0
    assert samples[("sluice_run_ttft_seconds_bucket", (("le", "+Inf"), *pool))] == 1.0
    assert samples[("sluice_run_tpot_seconds_count", pool)] == 1.0
    assert samples[("sluice_runs_total", (*pool, ("status", "COMPLETED")))] == 1.0
    decision = (("outcome", "round_robin"), ("policy", "round_robin"))
    assert samples[("sluice_router_decisions_total", decision)] == 1.0
    assert samples[("sluice_replica_healthy", (("replica", "r0"),))] == 1.0
    # The first token came after the run was accepted and before it finished, as the ledger saw
    # them. (Not compared with started_at: RUNNING is recorded off the first token's path, so the
    # two differ by however busy the box is.)
    row = await stack.run_row(run_id)
    whole_run = (row.finished_at - row.created_at).total_seconds()
    ttft_sum = samples[("sluice_run_ttft_seconds_sum", pool)]
    assert 0.0 < ttft_sum <= whole_run
