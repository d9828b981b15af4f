"""replica_client.is_ready on a plaintext replica: one unary ModelReady call over the connection the
token streams share (no grpc.aio channel), against a scripted HTTP/2 peer (tests/test_replica_conn.py);
the real replica answers it in tests/test_replica.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sluice.services import h2frames as h2
from sluice.services import replica_client as rc
from tritonclient.grpc import service_pb2

from sluice.replica.protocol import MODEL_NAME
from tests.test_replica_conn import SETUP, Peer, scripted_peers

READY_PATH = "/inference.GRPCInferenceService/ModelReady"


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, asyncio.Queue[Peer]]]:
    """A listener whose every connection is a Peer a test scripts; its address."""
    async with scripted_peers() as listening:
        try:
            yield listening
        finally:
            await rc.close_channels()


async def the_call(peer: Peer) -> int:
    """The client's ModelReady call as the peer reads it; its stream id."""
    await peer.handshake()
    headers = await peer.next_frame(*SETUP)
    assert headers.type == h2.HEADERS and headers.flags & h2.END_HEADERS
    request = await peer.next_frame(*SETUP)
    assert request.type == h2.DATA and request.flags & h2.END_STREAM      # a unary call: END_STREAM
    (body,) = h2.MessageReader().feed(request.payload)
    assert service_pb2.ModelReadyRequest.FromString(body).name == MODEL_NAME
    return headers.stream_id


def answer(peer: Peer, stream_id: int, ready: bool, status: str = "0") -> None:
    peer.headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    peer.data(stream_id, h2.grpc_message(service_pb2.ModelReadyResponse(ready=ready).SerializeToString()))
    peer.headers(stream_id, [("grpc-status", status), ("grpc-message", "")], end_stream=True)


async def test_a_ready_model_is_asked_once_over_the_shared_connection_without_a_grpc_channel(replica):
    address, peers = replica
    checking = asyncio.create_task(rc.is_ready(address, timeout_s=5))
    peer = await peers.get()
    answer(peer, await the_call(peer), ready=True)
    assert await checking is True
    checking = asyncio.create_task(rc.is_ready(address, timeout_s=5))    # the same connection again
    answer(peer, await peer_next_call(peer), ready=False)
    assert await checking is False
    assert peers.empty() and rc._state().channels == {}


async def peer_next_call(peer: Peer) -> int:
    headers = await peer.next_frame(*SETUP)
    await peer.next_frame(*SETUP)
    return headers.stream_id


async def test_an_error_status_is_not_ready(replica):
    address, peers = replica
    checking = asyncio.create_task(rc.is_ready(address, timeout_s=5))
    peer = await peers.get()
    answer(peer, await the_call(peer), ready=True, status="14")
    assert await checking is False


async def test_an_unanswered_check_is_not_ready_and_the_next_one_connects_afresh(replica):
    # Nothing else on the connection: it may lead to a peer that vanished without closing, which no
    # keepalive watches (pings go only where streams are open): the next check must not wait on it.
    address, peers = replica
    checking = asyncio.create_task(rc.is_ready(address, timeout_s=0.3))
    first = await peers.get()
    await the_call(first)
    assert await checking is False
    checking = asyncio.create_task(rc.is_ready(address, timeout_s=5))
    second = await asyncio.wait_for(peers.get(), 5)
    answer(second, await the_call(second), ready=True)
    assert await checking is True


async def test_an_unanswered_check_leaves_a_connection_that_carries_token_streams(replica):
    address, peers = replica
    streaming = asyncio.create_task(rc.stream_generate(address, "run-1", [1, 2], 4).__anext__())
    peer = await peers.get()
    await peer.handshake()
    await peer.next_frame(*SETUP)                    # the run's HEADERS and request
    await peer.next_frame(*SETUP)
    assert await rc.is_ready(address, timeout_s=0.3) is False
    connection = rc._state().connections[address]
    assert connection.usable and connection.open_streams == 1
    streaming.cancel()
