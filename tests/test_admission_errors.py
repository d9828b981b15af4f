"""The one RPC edge: domain errors become gRPC status + message (+ trailing metadata), anything
else becomes a generic INTERNAL, for unary and server-streaming handlers alike."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from sluice.services import errors
from sluice.services.errors import grpc_errors

SERVICE = "sluice.test.Edge"


class Edge:
    @grpc_errors
    async def Refuse(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise errors.ResourceExhausted("too big", metadata=[(errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "7")])

    @grpc_errors
    async def Crash(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RuntimeError("secret internals")

    @grpc_errors
    async def NoDatabase(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise ConnectionRefusedError(111, "Connect call failed")

    @grpc_errors
    async def Echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    @grpc_errors
    async def Stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"1"
        yield b"2"
        raise errors.Unavailable("shed", retry_after_ms=250)


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    edge = Edge()
    unary = ("Refuse", "Crash", "NoDatabase", "Echo")
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(edge, name)) for name in unary}
    handlers["Stream"] = grpc.unary_stream_rpc_method_handler(edge.Stream)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    await server.stop(None)


async def test_a_domain_error_becomes_its_status_message_and_trailing_metadata(channel):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Refuse")(b"")
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "too big")
    assert (errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "7") in tuple(caught.value.trailing_metadata())


async def test_an_unexpected_exception_is_a_generic_internal_without_internals(channel):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Crash")(b"")
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INTERNAL, errors.INTERNAL_ERROR)


async def test_a_lost_database_is_unavailable_with_a_retry_delay(channel):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/NoDatabase")(b"")
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, errors.DATABASE_UNAVAILABLE,
    )
    retry_after = (errors.RETRY_AFTER_MS_KEY, str(errors.DATABASE_RETRY_AFTER_MS))
    assert retry_after in tuple(caught.value.trailing_metadata())


async def test_a_successful_call_passes_through(channel):
    assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi") == b"hi"


async def test_a_stream_delivers_what_it_yielded_then_the_status(channel):
    call = channel.unary_stream(f"/{SERVICE}/Stream")(b"")
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for item in call:
            received.append(item)
    assert received == [b"1", b"2"]
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAVAILABLE, "shed")
    assert (errors.RETRY_AFTER_MS_KEY, "250") in tuple(caught.value.trailing_metadata())
