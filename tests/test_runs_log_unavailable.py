"""Runs.Stream when the event log fails under it (issue 10): the process's live tail loses its
Kafka consumer mid-stream. The stream ends UNAVAILABLE with a retry delay (trailing metadata and
google.rpc.RetryInfo), never INTERNAL, and a client resuming by cursor gets exactly the rest.
"""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2, status_pb2
from sluice.services.errors import RETRY_AFTER_MS_KEY, STATUS_DETAILS_KEY
from sluice.services.runs import EVENT_LOG_RETRY_AFTER_MS
from sluice_client.sdk import SluiceClient

from sluice.eventlog.interface import LOG_UNAVAILABLE
from sluice.v1 import common_pb2, runs_pb2
from tests.support.routing_stack import Stack, collect, deltas_tokens

pytestmark = pytest.mark.integration

TOKENS = 120          # 20 ms each: the stream is still live when its tail fails
BROKEN_AFTER = 5


async def test_a_live_tail_that_fails_mid_stream_ends_it_unavailable_with_a_retry_delay_and_resuming_is_exact(
        stack: Stack):
    await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit("Why do canals need locks?", max_output_tokens=TOKENS)
        received: list[runs_pb2.RunEvent] = []
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            async for event in sdk.stream_once(run.run_id):
                received.append(event)
                if len(received) == BROKEN_AFTER:
                    tail = stack.events.live_tail
                    assert tail is not None and tail._fetcher is not None
                    await tail._fetcher.close()        # the tail's Kafka fetcher is gone
        rest = await collect(sdk.stream(run.run_id, after=received[-1].sequence))
    error = broken.value
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details() == LOG_UNAVAILABLE.format(run_id=run.run_id, error="TailFailed")
    trailing = dict(error.trailing_metadata() or ())
    assert trailing[RETRY_AFTER_MS_KEY] == str(EVENT_LOG_RETRY_AFTER_MS)
    status = status_pb2.Status.FromString(trailing[STATUS_DETAILS_KEY])
    retry = error_details_pb2.RetryInfo()
    assert any(detail.Unpack(retry) for detail in status.details)
    assert retry.retry_delay.ToMilliseconds() == EVENT_LOG_RETRY_AFTER_MS
    events = received + rest
    assert [event.sequence for event in events] == list(range(1, len(events) + 1))
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
    assert deltas_tokens(events) == TOKENS == events[-1].usage.output_tokens
