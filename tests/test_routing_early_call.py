"""A routed run's replica call leaves while its claim is still being written (issue 9, TTFT;
services/routing/early_call.py), and nothing of it reaches the event log unless the claim commits.

The claim's queue statement (ACCEPTED -> QUEUED, the lease) is wrapped so that it first waits, up to
a bound, for the run's replica call to have delivered tokens: with the call sent only after COMMIT
it never has, and the test sees that. Real PostgreSQL, Kafka and Triton replicas.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from sluice.ledger.models import RunStatus
from sluice.services.admission_rules import ENGINE_DEFAULT, Sampling
from sluice.services.replica_client import TokenChunk
from sluice.services.routing import worker as worker_module
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.driver import TRITON
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice_client.sdk import SluiceClient

from sluice.v1 import common_pb2, runs_pb2
from tests.support.routing_stack import Stack, collect, deltas_tokens

pytestmark = pytest.mark.integration

TOKENS = 12
TAKEN_BEFORE_COMMIT = 3      # chunks the replica delivers while the claim waits (kept for the driver)
WAIT_S = 3.0                 # how long the claim waits for them; the simple engine needs ~60 ms


class CountingReplicas:
    """The Triton client, counting each call's chunks and noting how each call ended."""

    def __init__(self) -> None:
        self.chunks: dict[str, int] = {}
        self.endings: dict[str, list[str]] = {}
        self.delivered = asyncio.Condition()

    async def generate(self, address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                       end_id: int | None = None, *, cache_salt: int = 0, sampling: Sampling = ENGINE_DEFAULT,
                       on_chunk: Callable[[TokenChunk], None]) -> None:
        self.chunks[request_id] = 0

        def counted(chunk: TokenChunk) -> None:
            on_chunk(chunk)
            self.chunks[request_id] += len(chunk.token_ids)
            asyncio.get_running_loop().create_task(self._notify())

        try:
            await TRITON.generate(address, request_id, prompt_ids, max_new_tokens, end_id,
                                  cache_salt=cache_salt, sampling=sampling, on_chunk=counted)
        except asyncio.CancelledError:
            self.endings.setdefault(request_id, []).append("cancelled")
            raise
        self.endings.setdefault(request_id, []).append("ended")

    async def stop(self, address: str, request_id: str) -> None:
        await TRITON.stop(address, request_id)

    async def _notify(self) -> None:
        async with self.delivered:
            self.delivered.notify_all()

    async def wait_for_chunks(self, run_ids: Sequence[str], count: int, timeout_s: float) -> bool:
        """True once every run's call has delivered `count` tokens; False after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s), self.delivered:
                await self.delivered.wait_for(
                    lambda: all(self.chunks.get(run, 0) >= count for run in run_ids))
            return True
        except TimeoutError:
            return False


def queue_waiting_for(replicas: CountingReplicas, seen: list[bool], fail: list[bool]) -> Any:
    """queue_runs that first waits for the claimed runs' calls to deliver tokens (noting whether they
    did), then raises instead of queueing while `fail` holds True."""
    queue_runs = worker_module.queue_runs

    async def waiting(connection: Any, replica_of: dict[uuid.UUID, str], *args: Any) -> Any:
        seen.append(await replicas.wait_for_chunks([str(run) for run in replica_of], TAKEN_BEFORE_COMMIT,
                                                   WAIT_S))
        if fail and fail.pop(0):
            raise ConnectionResetError("the claim's connection dropped (test)")
        return await queue_runs(connection, replica_of, *args)

    return waiting


async def one_run(stack: Stack, monkeypatch: pytest.MonkeyPatch, replicas: CountingReplicas,
                  queue_runs: Any) -> tuple[str, list[runs_pb2.RunEvent]]:
    """One run submitted and streamed to its end, driven by a worker calling `replicas` whose claims
    queue through `queue_runs`: its id and events."""
    monkeypatch.setattr(worker_module, "queue_runs", queue_runs)
    settings = WorkerSettings.from_config(stack.config, new_owner_id("early"))
    worker = RoutingWorker(settings, stack.sessionmaker, stack.events, policy_from_config(stack.config),
                           registry_from_config(stack.config), dsn=stack.config.database.url,
                           replicas=replicas)
    serving = asyncio.create_task(worker.serve(drain_s=0.5))
    try:
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            run = await sdk.submit("Name a canal", max_output_tokens=TOKENS)
            return run.run_id, await collect(sdk.stream(run.run_id), timeout_s=30)
    finally:
        worker.stop()
        await serving


def assert_whole(events: list[runs_pb2.RunEvent]) -> None:
    assert [event.sequence for event in events] == list(range(1, len(events) + 1))
    assert common_pb2.RunStatus.Name(events[0].status) == "RUN_STATUS_RUNNING"
    assert common_pb2.RunStatus.Name(events[-1].status) == "RUN_STATUS_COMPLETED"
    assert deltas_tokens(events) == TOKENS


async def test_the_replica_call_leaves_before_the_claim_commits_and_its_early_tokens_reach_the_stream(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    replicas = CountingReplicas()
    seen: list[bool] = []
    run_id, events = await one_run(stack, monkeypatch, replicas, queue_waiting_for(replicas, seen, []))
    assert seen == [True]            # tokens were generated while the claim was not yet written ...
    assert_whole(events)             # ... and the stream has every one of them, in order, once
    assert replicas.endings == {run_id: ["ended"]}    # one call: the driver took the early one


async def test_a_claim_that_fails_cancels_its_call_publishes_nothing_and_the_next_claim_runs_it_whole(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    replicas = CountingReplicas()
    seen: list[bool] = []
    fail = [True]                    # the first claim fails after its run's call has produced tokens
    run_id, events = await one_run(stack, monkeypatch, replicas, queue_waiting_for(replicas, seen, fail))
    assert seen == [True, True]
    # The failed claim's call was cancelled, not left generating; the run was claimed again and
    # streamed from its first token: none of the cancelled call's tokens reached the log.
    assert replicas.endings == {run_id: ["cancelled", "ended"]}
    assert_whole(events)
    row = await stack.run_row(run_id)
    assert (row.status, row.lease_epoch) == (RunStatus.COMPLETED.value, 1)   # the failed claim left no epoch
