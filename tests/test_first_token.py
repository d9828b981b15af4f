"""The first token is never held: neither by the routing driver's coalescing window nor by the
event-log producer's linger (real PostgreSQL, Kafka and a Triton replica; issue 9, TTFT).

The replica takes TOKEN_DELAY_S per token, so its second token exists no sooner than
2 * TOKEN_DELAY_S after the Submit. The window and the linger are both longer than a token:
a first token held by either would reach the reader only after that instant (the window would
also fold the second token into it), so the bound below is worked out from the configured delays,
not from any measured latency."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import admission_pb2, admission_pb2_grpc, runs_pb2, runs_pb2_grpc
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica
from tests.support.routing_stack import Stack, open_stack

pytestmark = pytest.mark.integration

TOKEN_DELAY_S = 1.5          # the replica's time per token
COALESCE_MS = 10_000         # a DELTA window far longer than the run
LINGER_MS = 4_000            # the routing worker's producer batches this long: longer than a token
SECOND_TOKEN_S = 2 * TOKEN_DELAY_S   # the earliest the replica has a second token, counted from Submit


@pytest.fixture(scope="module")
def slow_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    replica = start_replica("slow0", Path(tmp_path_factory.mktemp("slow-replica")),
                            {"engine": "simple", "token_delay_ms": int(TOKEN_DELAY_S * 1000)})
    try:
        yield replica
    finally:
        stop_replica(replica)


@pytest.fixture
async def slow_stack(database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession],
                     slow_replica: ReplicaProcess, tmp_path: Path) -> AsyncIterator[Stack]:
    """The run path over the slow replica, its routing worker coalescing over COALESCE_MS and
    publishing through a producer that lingers LINGER_MS."""
    async with open_stack(database_dsn, sessionmaker, [slow_replica], tmp_path) as stack:
        stack.config = stack.config.updated(kafka={"coalesce_ms": COALESCE_MS})
        await stack.publish_through(KafkaEventLog(stack.config.kafka.bootstrap, stack.events.topic,
                                                  linger_ms=LINGER_MS))
        await stack.start_worker()
        yield stack


async def test_the_first_token_reaches_a_stream_reader_before_the_replica_has_a_second(slow_stack: Stack):
    metadata = (("x-api-key", slow_stack.tenant.api_key),)
    submitted = time.monotonic()
    run = await admission_pb2_grpc.AdmissionStub(slow_stack.channel).Submit(
        admission_pb2.SubmitRequest(model="chat", input=b"Tell me about sluice gates.", max_output_tokens=2,
                                    request_key=uuid.uuid4().hex), metadata=metadata)
    stream = runs_pb2_grpc.RunsStub(slow_stack.channel).Stream(
        runs_pb2.StreamRequest(run_id=run.run_id, after=0), metadata=metadata)
    first: runs_pb2.RunEvent | None = None
    async for event in stream:
        if event.type == runs_pb2.EVENT_TYPE_DELTA:
            first, first_delta_s = event, time.monotonic() - submitted
            break
    stream.cancel()
    assert first is not None, "the stream ended without a DELTA"
    assert len(first.token_ids) == 1, "the first DELTA waited for the second token"
    assert first_delta_s < SECOND_TOKEN_S, (
        f"the first DELTA reached the reader {first_delta_s:.2f}s after Submit, when the replica could"
        f" already have its second token ({SECOND_TOKEN_S:.1f}s): held by the window or the linger")
