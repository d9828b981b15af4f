"""The run path end to end on the real PostgreSQL, Kafka and Triton replicas:
submit → routing worker → replica → sequenced events in Kafka → Stream, with
resume, cancel, worker loss and tenant isolation (seed 002, DESIGN.md)."""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import RunStatus
from sluice.services.runs import RUN_NOT_FOUND
from sluice_client.sdk import SluiceClient

from sluice.v1 import common_pb2, runs_pb2
from tests.support.ledger_factories import budget_row
from tests.support.routing_stack import Stack, collect, deltas_tokens

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."


def client(stack: Stack, api_key: str | None = None) -> SluiceClient:
    return SluiceClient(stack.address, api_key or stack.tenant.api_key)


async def test_an_accepted_run_streams_events_1_to_n_and_completes_with_its_usage(stack: Stack):
    await stack.start_worker()
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=40)
        events = await collect(sdk.stream(run.run_id))
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert events[0].type == runs_pb2.EVENT_TYPE_STATUS and events[0].status == common_pb2.RUN_STATUS_RUNNING
    terminal = events[-1]
    assert terminal.type == runs_pb2.EVENT_TYPE_TERMINAL
    assert terminal.status == common_pb2.RUN_STATUS_COMPLETED
    assert deltas_tokens(events) == 40 == terminal.usage.output_tokens
    assert terminal.usage.input_tokens == run.input_tokens
    row = await stack.wait_for_published(run.run_id)
    assert row.status == RunStatus.COMPLETED
    assert row.terminal_sequence == terminal.sequence == row.last_sequence


def event_key(event: runs_pb2.RunEvent) -> tuple:  # type: ignore[type-arg]
    """What a reader can compare across replays (time_ms included: replays are byte-identical)."""
    return (event.sequence, event.type, tuple(event.token_ids), event.text, event.status,
            event.usage.output_tokens, event.time_ms)


async def first_events(sdk: SluiceClient, run_id: str, count: int) -> list[runs_pb2.RunEvent]:
    """Read `count` events on one Stream call, then drop the connection."""
    call = sdk.stream_once(run_id)
    events: list[runs_pb2.RunEvent] = []
    async for event in call:
        events.append(event)
        if len(events) == count:
            break
    call.cancel()
    return events


async def test_seed_002_a_client_that_drops_after_event_35_resumes_with_exactly_36_to_n(stack: Stack):
    await stack.start_worker()
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=60)
        seen = await first_events(sdk, run.run_id, 35)
        resumed = await collect(sdk.stream(run.run_id, after=35))
        replay = await collect(sdk.stream(run.run_id))
    assert [e.sequence for e in seen] == list(range(1, 36))
    assert [e.sequence for e in resumed] == list(range(36, replay[-1].sequence + 1))
    assert [event_key(e) for e in seen + resumed] == [event_key(e) for e in replay]
    assert resumed[-1].type == runs_pb2.EVENT_TYPE_TERMINAL
    assert deltas_tokens(replay) == 60


async def test_a_stream_after_the_terminal_sequence_is_empty_and_ends(stack: Stack):
    await stack.start_worker()
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=5)
        events = await collect(sdk.stream(run.run_id))
        assert await collect(sdk.stream_once(run.run_id, after=events[-1].sequence)) == []
        assert [e.sequence for e in await collect(sdk.stream_once(run.run_id, after=events[-2].sequence))] \
            == [events[-1].sequence]


async def test_an_sdk_stream_from_the_terminal_cursor_ends_at_once_without_resuming(stack: Stack):
    await stack.start_worker()
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=5)
        events = await collect(sdk.stream(run.run_id))
        cursor = (await sdk.get_run(run.run_id)).last_sequence
        assert cursor == events[-1].sequence
        # The cursor GetRun reports for a finished run leaves nothing to send: the stream ends
        # (its resume backoff alone would take 6 s before giving up with StreamBroken).
        started = time.monotonic()
        assert await asyncio.wait_for(collect(sdk.stream(run.run_id, after=cursor)), 3) == []
        assert time.monotonic() - started < 1.0


async def test_a_stream_opened_before_any_worker_waits_for_the_run_to_start(stack: Stack):
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=8)
        reader = asyncio.create_task(collect(sdk.stream(run.run_id)))
        await asyncio.sleep(0.5)
        assert not reader.done()
        await stack.start_worker()
        events = await asyncio.wait_for(reader, 30)
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))


async def test_two_runs_instances_streaming_the_same_run_concurrently_give_identical_events(stack: Stack):
    await stack.start_worker()
    one, two = await stack.start_runs_server(), await stack.start_runs_server()
    async with client(stack) as sdk, SluiceClient(one.address, stack.tenant.api_key) as a, \
            SluiceClient(two.address, stack.tenant.api_key) as b:
        run = await sdk.submit(PROMPT, max_output_tokens=50)
        from_a, from_b = await asyncio.gather(collect(a.stream(run.run_id)), collect(b.stream(run.run_id)))
    assert [event_key(e) for e in from_a] == [event_key(e) for e in from_b]
    assert [e.sequence for e in from_a] == list(range(1, len(from_a) + 1))
    assert from_a[-1].status == common_pb2.RUN_STATUS_COMPLETED


async def test_the_sdk_resumes_by_itself_when_its_runs_instance_restarts_mid_stream(stack: Stack):
    await stack.start_worker()
    runs = await stack.start_runs_server()
    events: list[runs_pb2.RunEvent] = []
    async with client(stack) as sdk, SluiceClient(runs.address, stack.tenant.api_key,
                                                  resume_backoff_s=0.1, max_resumes=10) as resuming:
        run = await sdk.submit(PROMPT, max_output_tokens=80)
        async for event in resuming.stream(run.run_id):
            events.append(event)
            if len(events) == 10:
                await runs.stop()                               # the connection breaks mid-stream
                runs = await stack.start_runs_server(runs.port)  # and the service comes back
        replay = await collect(sdk.stream(run.run_id))
    assert [event_key(e) for e in events] == [event_key(e) for e in replay]
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED


async def test_cancel_mid_stream_ends_cancelled_charges_consumed_tokens_and_releases_the_rest(stack: Stack):
    await stack.start_worker()
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=500)
        seen = await first_events(sdk, run.run_id, 10)
        started = time.monotonic()
        reply = await sdk.cancel(run.run_id)
        rest = await collect(sdk.stream(run.run_id, after=seen[-1].sequence))
        cancel_s = time.monotonic() - started
    events = seen + rest
    terminal = events[-1]
    assert reply.status == common_pb2.RUN_STATUS_RUNNING  # the status when the intent was committed
    assert terminal.type == runs_pb2.EVENT_TYPE_TERMINAL
    assert terminal.status == common_pb2.RUN_STATUS_CANCELLED
    assert terminal.usage.output_tokens == deltas_tokens(events) < 500
    assert cancel_s < 2.0
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    consumed = run.input_tokens + terminal.usage.output_tokens
    assert (budget.reserved_tokens, budget.used_tokens) == (0, consumed)
    assert budget.used_cost_micros == terminal.usage.cost_micros
    row = await stack.run_row(run.run_id)
    assert row.status == RunStatus.CANCELLED and row.cancel_requested_at is not None


async def test_cancel_before_any_worker_takes_the_run_settles_it_at_once_with_nothing_charged(stack: Stack):
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=50)
        reply = await sdk.cancel(run.run_id)
        events = await collect(sdk.stream(run.run_id))
        again = await sdk.cancel(run.run_id)
    assert reply.status == again.status == common_pb2.RUN_STATUS_CANCELLED
    assert [(e.sequence, e.type, e.status) for e in events] == [
        (1, runs_pb2.EVENT_TYPE_TERMINAL, common_pb2.RUN_STATUS_CANCELLED)]
    assert events[0].usage == common_pb2.TokenUsage()
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens, budget.used_cost_micros) == (0, 0, 0)
    await stack.start_worker()
    await asyncio.sleep(0.5)
    assert (await stack.run_row(run.run_id)).replica is None  # never claimed afterwards


async def test_another_tenant_gets_not_found_on_get_run_stream_and_cancel(stack: Stack):
    await stack.start_worker()
    async with client(stack) as owner, client(stack, stack.other.api_key) as stranger:
        run = await owner.submit(PROMPT, max_output_tokens=30)
        expected = RUN_NOT_FOUND.format(run_id=run.run_id)
        for call in (stranger.get_run(run.run_id), collect(stranger.stream(run.run_id)),
                     stranger.cancel(run.run_id)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.NOT_FOUND, expected)
        events = await collect(owner.stream(run.run_id))
        mine = await owner.get_run(run.run_id)
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED  # the stranger's cancel did nothing
    assert mine.status == common_pb2.RUN_STATUS_COMPLETED and mine.usage.output_tokens == 30


async def test_an_unknown_or_malformed_run_id_is_not_found(stack: Stack):
    async with client(stack) as sdk:
        for run_id in ("00000000-0000-0000-0000-000000000000", "not-a-uuid"):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await sdk.get_run(run_id)
            assert (caught.value.code(), caught.value.details()) == (
                grpc.StatusCode.NOT_FOUND, RUN_NOT_FOUND.format(run_id=run_id))


async def test_get_run_reports_progress_while_running_and_settled_usage_at_the_end(stack: Stack):
    await stack.start_worker()
    async with client(stack) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=250)  # 5 s at 20 ms per token
        await first_events(sdk, run.run_id, 20)
        await asyncio.sleep(1.0)  # a lease renewal (every lease/5) records durable progress
        running = await sdk.get_run(run.run_id)
        events = await collect(sdk.stream(run.run_id))
        done = await sdk.get_run(run.run_id)
    assert running.status == common_pb2.RUN_STATUS_RUNNING and running.replica in ("r0", "r1")
    assert 0 < running.usage.output_tokens < 250 and running.last_sequence > 0
    assert done.status == common_pb2.RUN_STATUS_COMPLETED
    assert done.usage == events[-1].usage and done.last_sequence == events[-1].sequence
    assert done.started_at_ms >= done.created_at_ms and done.finished_at_ms >= done.started_at_ms
