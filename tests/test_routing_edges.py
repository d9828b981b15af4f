"""Routing edges on the real stack: deadlines, a terminal event whose publication was
interrupted, the Routing API, and the `sluice` CLI."""

from __future__ import annotations

import asyncio
import io
import json

import grpc
import grpc.aio
import pytest
from sluice.ledger import audit
from sluice.ledger.claims_sql import queue_runs
from sluice.ledger.models import Run, RunStatus
from sluice.services.finish import Ending, settle_and_fix_terminal
from sluice.services.routing import worker as routing_worker
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.servicer import REPLICA_NAME_MISSING
from sluice.services.routing.worker import (
    DETAIL_EXPIRED_BEFORE_START,
    RoutingWorker,
    WorkerSettings,
    new_owner_id,
)
from sluice_client import cli
from sluice_client.sdk import SluiceClient
from sqlalchemy import select

from sluice.v1 import common_pb2, routing_pb2, runs_pb2
from tests.support.admin_services import make_admin_key
from tests.support.routing_stack import MODEL, Stack, collect, deltas_tokens, routing_api

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."


# --- deadlines -------------------------------------------------------------------------------


async def test_a_run_past_its_deadline_mid_stream_ends_expired_and_pays_for_what_it_produced(stack: Stack):
    await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        # Feasible for admission (100 tokens at its floor of 7 ms each: 0.7 s), but this replica
        # takes 20 ms a token (2 s), so the deadline passes mid-stream.
        run = await sdk.submit(PROMPT, max_output_tokens=100, deadline_ms=1_000)
        events = await collect(sdk.stream(run.run_id))
    terminal = events[-1]
    assert terminal.status == common_pb2.RUN_STATUS_EXPIRED
    assert 0 < terminal.usage.output_tokens == deltas_tokens(events) < 100


async def test_a_run_whose_deadline_passed_before_any_worker_took_it_expires_without_running(stack: Stack):
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        # A deadline admission accepts (one token needs ~8 ms at its floor), then no worker for 100 ms.
        run = await sdk.submit(PROMPT, max_output_tokens=1, deadline_ms=20)
        await asyncio.sleep(0.1)
        await stack.start_worker()
        events = await collect(sdk.stream(run.run_id))
    assert [(e.sequence, e.status, e.detail) for e in events] == [
        (1, common_pb2.RUN_STATUS_EXPIRED, DETAIL_EXPIRED_BEFORE_START)]
    assert events[0].usage == common_pb2.TokenUsage()
    assert (await stack.run_row(run.run_id)).replica is None


# --- a terminal event that was settled but never published ------------------------------------


async def test_a_settled_run_whose_terminal_event_was_never_published_gets_it_from_a_reaper(stack: Stack):
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=50)
        # Step 1 of finishing (settle + terminal sequence) commits; the process dies before step 2.
        async with stack.sessionmaker() as session, session.begin():
            await settle_and_fix_terminal(session, run.run_id, Ending(RunStatus.CANCELLED, 0, 0, "gone"),
                                          owner="crashed:1:abc", lease_seconds=1)
        reader = asyncio.create_task(collect(sdk.stream(run.run_id)))
        await asyncio.sleep(0.3)
        assert not reader.done()  # nothing in the log yet: the stream waits
        await stack.start_worker()
        events = await asyncio.wait_for(reader, 15)
    assert [(e.sequence, e.type, e.status, e.detail) for e in events] == [
        (1, runs_pb2.EVENT_TYPE_TERMINAL, common_pb2.RUN_STATUS_CANCELLED, "gone")]
    row = await stack.wait_for_published(run.run_id)
    assert row.lease_owner != "crashed:1:abc"


# --- a claim that rolls back ------------------------------------------------------------------


async def test_a_claim_whose_transaction_fails_leaves_its_runs_accepted_and_no_replica_loaded(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    worker = RoutingWorker(WorkerSettings.from_config(stack.config, new_owner_id("test")), stack.sessionmaker,
                           stack.events, policy_from_config(stack.config),
                           registry_from_config(stack.config))
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        runs = [await sdk.submit(PROMPT, max_output_tokens=4) for _ in range(2)]
    queued: list[object] = []

    async def fails_once_queued(*args: object, **kwargs: object) -> object:
        # Both runs are queued by the one statement, then the transaction fails before its COMMIT.
        queued.append(await queue_runs(*args, **kwargs))  # type: ignore[arg-type]
        raise RuntimeError("the ledger went away mid-claim")

    monkeypatch.setattr(routing_worker, "queue_runs", fails_once_queued)

    try:
        with pytest.raises(RuntimeError):
            await worker.claim_once()
    finally:
        await worker.pool.close()       # serve() is not running to close it: no pool left behind

    assert len(queued[0]) == 2                                # queued, then rolled back
    assert [(await stack.run_row(run.run_id)).status for run in runs] == [RunStatus.ACCEPTED] * 2
    assert {name: load.in_flight for name, load in worker.loads.loads().items() if load.in_flight} == {}


# --- Routing API -------------------------------------------------------------------------------


async def test_the_routing_api_lists_edits_and_explains_the_registry_of_its_process(stack: Stack):
    worker = await stack.start_worker()
    admin = (("x-api-key", await make_admin_key(stack.sessionmaker)),)
    async with routing_api(worker) as routing:
        listed = await routing.ListReplicas(routing_pb2.ListReplicasRequest(), metadata=admin)
        explained = await routing.Explain(routing_pb2.ExplainRequest(model_version=MODEL.version,
                                                                     token_ids=[5, 6, 7]),
                                          metadata=(("x-api-key", stack.tenant.api_key),))
        added = await routing.UpsertReplica(routing_pb2.Replica(name="r7", pool=MODEL.version,
                                                                grpc_address="127.0.0.1:1"), metadata=admin)
        relisted = await routing.ListReplicas(routing_pb2.ListReplicasRequest(), metadata=admin)
        after_add = [r.name for r in relisted.replicas]
        removed = await routing.RemoveReplica(routing_pb2.RemoveReplicaRequest(name="r7"), metadata=admin)
        removed_again = await routing.RemoveReplica(routing_pb2.RemoveReplicaRequest(name="r7"),
                                                    metadata=admin)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await routing.UpsertReplica(routing_pb2.Replica(grpc_address="127.0.0.1:1"), metadata=admin)
    assert listed.policy == "round_robin"
    assert [(r.name, r.pool, r.healthy) for r in listed.replicas] == [
        ("r0", MODEL.version, True), ("r1", MODEL.version, True)]
    assert explained.replica in ("r0", "r1") and explained.outcome == "round_robin"
    assert added.name == "r7" and after_add == ["r0", "r1", "r7"]
    assert (removed.removed, removed_again.removed) == (True, False)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                             REPLICA_NAME_MISSING)
    # Each edit left one audit row naming the admin key and this process; the no-op removal none.
    async with stack.sessionmaker() as session:
        rows = list(reversed(await audit.recent(session, 10)))
    admin_prefix = admin[0][1].split("_")[0]     # a key is "<prefix>_<secret>" (ledger/keys.py)
    where = f"r7 @ {worker.settings.owner}"
    assert [(r.action, r.target, r.actor) for r in rows] == [
        ("routing.replica.upsert", where, admin_prefix), ("routing.replica.remove", where, admin_prefix)]
    assert rows[0].before is None and rows[0].after["grpc_address"] == "127.0.0.1:1"
    assert rows[1].before["name"] == "r7" and rows[1].after is None


# --- the sluice CLI -------------------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    return code, out.getvalue()


async def test_sluice_chat_streams_the_answer_and_runs_get_tail_and_usage_report_on_it(stack: Stack):
    await stack.start_worker()
    key = ("--api-key", stack.tenant.api_key, "--address", stack.address)
    code, chat = await asyncio.to_thread(run_cli, "chat", PROMPT, "--model", MODEL.version,
                                         "--max-tokens", "12", *key)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_id = (await collect_run_ids(stack))[0]
        events = await collect(sdk.stream(run_id))
    text = "".join(e.text for e in events)
    assert code == cli.EXIT_OK
    assert chat.startswith(text) and "[COMPLETED: " in chat and " 12 output tokens" in chat
    code, got = await asyncio.to_thread(run_cli, "runs", "get", run_id, *key)
    assert code == cli.EXIT_OK and json.loads(got)["status"] == "RUN_STATUS_COMPLETED"
    code, tail = await asyncio.to_thread(run_cli, "runs", "tail", run_id, "--after", "3", *key)
    assert [json.loads(line)["sequence"] for line in tail.splitlines()] == [
        str(e.sequence) for e in events[3:]]  # int64 travels as a string in proto JSON
    code, usage = await asyncio.to_thread(run_cli, "usage", *key)
    assert json.loads(usage)["settled_total"]["output_tokens"] == "12"


async def test_sluice_runs_cancel_and_a_strangers_get_is_not_found(stack: Stack, capsys):
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=50)
    code, said = await asyncio.to_thread(run_cli, "runs", "cancel", run.run_id, "--api-key",
                                         stack.tenant.api_key, "--address", stack.address)
    assert (code, said.strip()) == (cli.EXIT_OK, f"cancel requested for run {run.run_id} (status CANCELLED)")
    code, _ = await asyncio.to_thread(run_cli, "runs", "get", run.run_id, "--api-key", stack.other.api_key,
                                      "--address", stack.address)
    assert code == cli.EXIT_RPC_ERROR
    assert capsys.readouterr().err.startswith("sluice: NOT_FOUND: run ")


async def collect_run_ids(stack: Stack) -> list[str]:
    async with stack.sessionmaker() as session:
        return [str(run_id) for run_id in (await session.scalars(select(Run.id))).all()]


async def test_the_routing_api_edits_its_registry_only_for_an_admin_key(stack: Stack):
    """DESIGN.md "Keys and scopes": replicas are admin's. Without the check, anyone reaching the
    port could add a replica of their own and receive other tenants' prompts."""
    worker = await stack.start_worker()
    rogue = routing_pb2.Replica(name="rogue", pool=MODEL.version, grpc_address="127.0.0.1:1")
    tenant = (("x-api-key", stack.tenant.api_key),)
    remove = routing_pb2.RemoveReplicaRequest(name="r0")
    async with routing_api(worker) as routing:
        codes = []
        for call in (lambda: routing.UpsertReplica(rogue),
                     lambda: routing.UpsertReplica(rogue, metadata=tenant),
                     lambda: routing.RemoveReplica(remove, metadata=tenant),
                     lambda: routing.ListReplicas(routing_pb2.ListReplicasRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call()
            codes.append(caught.value.code())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                     grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED]
    assert [spec.name for spec in worker.registry.specs()] == ["r0", "r1"]
    async with stack.sessionmaker() as session:
        assert await audit.recent(session, 10) == []
