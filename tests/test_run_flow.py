"""The run path end to end on the real PostgreSQL, Kafka and Triton replicas:
submit → routing worker → replica → sequenced events in Kafka → Stream, with
resume, cancel, worker loss and tenant isolation (seed 002, DESIGN.md)."""

from __future__ import annotations

import pytest

from clients.sdk import SluiceClient
from ledger.models import RunStatus
from sluice.v1 import common_pb2, runs_pb2
from tests.support.routing_stack import Stack

pytest_plugins = ["tests.support.db", "tests.support.routing_stack"]
pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."


def client(stack: Stack, api_key: str | None = None) -> SluiceClient:
    return SluiceClient(stack.address, api_key or stack.tenant.api_key)


async def collect(stream) -> list[runs_pb2.RunEvent]:  # type: ignore[no-untyped-def]
    return [event async for event in stream]


def deltas_tokens(events: list[runs_pb2.RunEvent]) -> int:
    return sum(len(e.token_ids) for e in events if e.type == runs_pb2.EVENT_TYPE_DELTA)


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
    row = await stack.run_row(run.run_id)
    assert row.status == RunStatus.COMPLETED and row.terminal_published
    assert row.terminal_sequence == terminal.sequence == row.last_sequence
