"""services/h2server.py: gRPC served on the event loop, held to grpc.aio's behaviour through real grpc
clients: status, details and trailing metadata; the caller's metadata; deadlines; cancellation;
server streaming under flow control; client streaming; unknown methods; oversized requests; GOAWAY
on stop; SO_REUSEPORT only when asked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import hpack
import pytest
from sluice.services import grpc_wire as wire
from sluice.services import h2frames as h2
from sluice.services import h2server, replica_conn
from sluice.services.h2server import (
    ERR_UNIMPLEMENTED,
    MAX_RECEIVE_BYTES,
    REFUSED_STREAM,
    H2Connection,
    H2Server,
)

SERVICE = "test.Echo"
def identity(data: bytes) -> bytes:
    return data


class Probe:
    """What the handlers saw, for the tests to assert on."""

    def __init__(self) -> None:
        self.metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.sent = 0
        self.ended = asyncio.Event()       # a handler's finally ran (returned, cancelled or failed)
        self.cancelled = False
        self.release = asyncio.Event()     # Hold's handler reads its requests only once this is set


def handlers(probe: Probe) -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: Any) -> bytes:
        probe.metadata = context.invocation_metadata()
        return request

    async def fail(request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "budget période closed: retry in 5 s",
                            trailing_metadata=(("retry-after-ms", "5000"), ("detail-bin", b"\x00\xffraw")))
        raise AssertionError("abort returns only by raising")

    async def big_trailers(request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.ABORTED, "see the trailers",
                            trailing_metadata=(("note", "n" * int(request)),))
        raise AssertionError("abort returns only by raising")

    async def slow(request: bytes, context: Any) -> bytes:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            probe.cancelled = True
            raise
        finally:
            probe.ended.set()
        return request

    async def count(request: bytes, context: Any) -> AsyncIterator[bytes]:
        total, size = int(request.split(b"x")[0]), int(request.split(b"x")[1])
        try:
            for index in range(total):
                probe.sent = index + 1
                yield index.to_bytes(4, "big") * (size // 4)
        except asyncio.CancelledError:
            probe.cancelled = True
            raise
        finally:
            probe.ended.set()

    async def wait(request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.sleep(30)          # as Runs.Stream waits for a run's next event
            yield b"never"
        except asyncio.CancelledError:
            probe.cancelled = True
            raise
        finally:
            probe.ended.set()

    async def paced(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for index in range(int(request)):
            await asyncio.sleep(0.05)        # a run's events, 50 ms apart
            yield b"%d" % index

    async def length(request: bytes, context: Any) -> bytes:
        return b"%d" % len(request)

    async def concat(requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"|".join([item async for item in requests])

    async def hold(requests: AsyncIterator[bytes], context: Any) -> bytes:
        await probe.release.wait()           # a handler busy elsewhere (as one blocked writing)
        received = [item async for item in requests]
        return b"%d %d" % (len(received), sum(len(item) for item in received))

    async def bidi(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for item in requests:
            yield item.upper()

    table = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, identity, identity),
        "Fail": grpc.unary_unary_rpc_method_handler(fail, identity, identity),
        "BigTrailers": grpc.unary_unary_rpc_method_handler(big_trailers, identity, identity),
        "Slow": grpc.unary_unary_rpc_method_handler(slow, identity, identity),
        "Count": grpc.unary_stream_rpc_method_handler(count, identity, identity),
        "Wait": grpc.unary_stream_rpc_method_handler(wait, identity, identity),
        "Paced": grpc.unary_stream_rpc_method_handler(paced, identity, identity),
        "Len": grpc.unary_unary_rpc_method_handler(length, identity, identity),
        "Concat": grpc.stream_unary_rpc_method_handler(concat, identity, identity),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, identity, identity),
        "Hold": grpc.stream_unary_rpc_method_handler(hold, identity, identity),
    }
    return grpc.method_handlers_generic_handler(SERVICE, table)


async def started(probe: Probe) -> tuple[H2Server, str]:
    """A server of the test handlers on a free port, which the test stops itself."""
    server = H2Server()
    server.add_generic_rpc_handlers((handlers(probe),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, address


@contextlib.asynccontextmanager
async def serving(probe: Probe, reuse_port: bool = False) -> AsyncIterator[tuple[H2Server, str]]:
    server = H2Server(reuse_port)
    server.add_generic_rpc_handlers((handlers(probe),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def rest_of(call: Any) -> list[bytes]:
    """Every message left on a stream call (read() to its end: grpc.aio forbids mixing it with iteration)."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


def method(channel: grpc.aio.Channel, name: str, kind: str = "unary_unary") -> Any:
    return getattr(channel, kind)(f"/{SERVICE}/{name}", request_serializer=identity,
                                  response_deserializer=identity)


async def test_a_unary_call_hands_the_callers_metadata_over_and_answers_its_response():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        answer = await method(channel, "Echo")(b"hello", metadata=(
            ("authorization", "Bearer sk-test-1"), ("trace-bin", b"\x01\x02\xff")))
    assert answer == b"hello"
    seen = dict(probe.metadata)
    assert seen["authorization"] == "Bearer sk-test-1"
    assert seen["trace-bin"] == b"\x01\x02\xff"


class Answer:
    """A replica_conn sink of one unary call."""

    def __init__(self) -> None:
        self.body = b""
        self.done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def message(self, body: bytes) -> None:
        self.body = body

    def closed(self, code: str | None, details: str) -> None:
        self.done.set_result(code)


async def test_the_lean_clients_calls_carry_each_their_own_metadata_on_one_connection():
    """services/replica_conn.py keeps one request header block per (path, metadata): calls with
    other metadata on the same connection must not reuse another's."""
    probe = Probe()
    async with serving(probe) as (_, address):
        connection = await replica_conn.connect(address)
        try:
            seen = []
            for key in ("sk-a", "sk-b", "sk-a"):
                answer = Answer()
                stream_id = connection.start(f"/{SERVICE}/Echo", answer, (("x-api-key", key),))
                await connection.send(stream_id, key.encode(), last=True)
                assert await answer.done is None and answer.body == key.encode()
                seen.append(dict(probe.metadata)["x-api-key"])
            answer = Answer()
            await connection.send(connection.start(f"/{SERVICE}/Echo", answer), b"none", last=True)
            assert await answer.done is None and "x-api-key" not in dict(probe.metadata)
        finally:
            connection.close()
    assert seen == ["sk-a", "sk-b", "sk-a"]


async def test_an_abort_reaches_the_client_with_its_code_details_and_trailing_metadata():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await method(channel, "Fail")(b"")
    error = refused.value
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == "budget période closed: retry in 5 s"
    trailing = dict(error.trailing_metadata() or ())
    assert trailing["retry-after-ms"] == "5000"
    assert trailing["detail-bin"] == b"\x00\xffraw"


async def test_trailers_longer_than_a_frame_go_out_in_continuation_frames():
    probe = Probe()
    size = 40_000                     # well over the client's 16 KiB SETTINGS_MAX_FRAME_SIZE
    async with serving(probe) as (_, address), \
            grpc.aio.insecure_channel(address, options=[("grpc.max_metadata_size", 1 << 20)]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await method(channel, "BigTrailers")(b"%d" % size)
    assert refused.value.code() is grpc.StatusCode.ABORTED
    assert dict(refused.value.trailing_metadata() or ())["note"] == "n" * size


async def test_an_unknown_method_is_unimplemented():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary("/test.Echo/Nope", request_serializer=identity,
                                      response_deserializer=identity)(b"")
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert refused.value.details() == ERR_UNIMPLEMENTED


async def test_a_deadline_cancels_the_handler_and_answers_deadline_exceeded():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await method(channel, "Slow")(b"", timeout=0.3)
        await asyncio.wait_for(probe.ended.wait(), 2.0)
    assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert probe.cancelled


async def test_a_client_that_cancels_a_waiting_stream_cancels_its_handler():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        call = method(channel, "Wait", "unary_stream")(b"")
        assert await call.read() == b"first"
        call.cancel()
        await asyncio.wait_for(probe.ended.wait(), 2.0)
    assert probe.cancelled


async def test_a_client_that_cancels_a_writing_stream_stops_its_handler():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        call = method(channel, "Count", "unary_stream")(b"1000000x4096")
        assert (await call.read())[:4] == (0).to_bytes(4, "big")
        call.cancel()
        await asyncio.wait_for(probe.ended.wait(), 2.0)
    assert probe.sent < 1_000_000


async def test_a_stream_waits_for_a_reader_that_does_not_read_and_then_delivers_every_message_in_order():
    probe = Probe()
    total, size = 64, 1 << 20        # 64 MiB: far beyond any window and socket buffer of one connection
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        call = method(channel, "Count", "unary_stream")(f"{total}x{size}".encode())
        first = await call.read()
        await asyncio.sleep(1.0)
        held = probe.sent
        rest = await rest_of(call)
    assert held < total, "the writer went on past every window while nobody read"
    received = [first, *rest]
    assert [message[:4] for message in received] == [index.to_bytes(4, "big") for index in range(total)]
    assert all(len(message) == size for message in received)
    assert await call.code() is grpc.StatusCode.OK


async def test_client_and_bidirectional_streams_are_served():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        joined = await method(channel, "Concat", "stream_unary")(iter([b"a", b"b", b"c"]))
        upper = [item async for item in method(channel, "Bidi", "stream_stream")(iter([b"x", b"yz"]))]
    assert joined == b"a|b|c"
    assert upper == [b"X", b"YZ"]


def queued_requests(server: H2Server) -> int:
    """Request messages the server holds for handlers that have not read them yet."""
    return sum(call.requests.qsize() for connection in server.connections
               for call in connection.calls.values() if call.requests is not None)


async def test_a_client_streaming_faster_than_its_handler_reads_is_held_to_the_stream_window():
    # The stream's receive window is given back as the handler reads, not as messages arrive: a client
    # writing 8 MiB to a handler that does not read gets at most one window (plus the message that
    # crossed it) queued on the server, then waits; once the handler reads, everything arrives.
    probe = Probe()
    size, total = 16 * 1024, 512
    message_on_wire = size + 5                       # the gRPC prefix of each message
    async with serving(probe) as (server, address), grpc.aio.insecure_channel(address) as channel:
        call = method(channel, "Hold", "stream_unary")()

        async def write_all() -> None:
            for index in range(total):
                await call.write(index.to_bytes(4, "big") * (size // 4))
            await call.done_writing()

        writing = asyncio.create_task(write_all())
        held, settled_since = -1, asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - settled_since < 1.0:   # until it stops growing
            await asyncio.sleep(0.05)
            if (now := queued_requests(server)) != held:
                held, settled_since = now, asyncio.get_running_loop().time()
        assert not writing.done()                    # the client is held back, not buffered without end
        assert 0 < held * message_on_wire <= h2server.STREAM_WINDOW + message_on_wire
        probe.release.set()
        answer = await asyncio.wait_for(call, 30.0)
        await writing
    assert answer == b"%d %d" % (total, total * size)


async def test_a_client_that_sends_past_the_stream_window_has_its_stream_reset():
    # A bare client that ignores flow control: one byte past the window resets the stream
    # (FLOW_CONTROL_ERROR) instead of being queued; the handler is cancelled.
    probe = Probe()
    message = h2.grpc_message(b"m" * (16 * 1024 - 5))           # one full frame each
    frames_in_window = h2server.STREAM_WINDOW // len(message)
    async with serving(probe) as (server, address):
        client = await RawClient.connect(address)
        client.open(1, "Hold")
        for _ in range(frames_in_window):
            client.writer.write(h2.frame(h2.DATA, 0, 1, message))
        await asyncio.sleep(0.3)
        assert queued_requests(server) == frames_in_window       # within the window: all queued
        client.writer.write(h2.frame(h2.DATA, 0, 1, message))    # past it
        reset = await client.until(ends(1))
        client.close()
    assert reset.type == h2.RST_STREAM and h2.parse_u32(reset.payload) == h2server.FLOW_CONTROL_ERROR
    assert queued_requests(server) == 0


async def test_a_client_that_compresses_its_requests_is_served():
    probe = Probe()
    payload = b"the same words " * 1000
    async with serving(probe) as (_, address):
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            async with grpc.aio.insecure_channel(address, compression=compression) as channel:
                assert await method(channel, "Len")(payload) == b"%d" % len(payload)
                assert await method(channel, "Concat", "stream_unary")(iter([b"ab", b"cd"])) == b"ab|cd"


async def test_a_compressed_request_that_inflates_above_the_receive_limit_is_resource_exhausted():
    probe = Probe()
    async with serving(probe) as (_, address), \
            grpc.aio.insecure_channel(address, compression=grpc.Compression.Gzip) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await method(channel, "Len")(b"\0" * (MAX_RECEIVE_BYTES + 1))   # ~4 KiB on the wire
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_request_above_the_receive_limit_is_resource_exhausted():
    probe = Probe()
    async with serving(probe) as (_, address), grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await method(channel, "Len")(b"x" * (MAX_RECEIVE_BYTES + 1))
        assert await method(channel, "Len")(b"x" * MAX_RECEIVE_BYTES) == b"%d" % MAX_RECEIVE_BYTES
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_stop_lets_a_stream_in_progress_finish_within_the_grace_and_refuses_new_calls():
    probe = Probe()
    server, address = await started(probe)
    async with grpc.aio.insecure_channel(address) as channel:
        call = method(channel, "Paced", "unary_stream")(b"20")
        await call.read()
        stopping = asyncio.create_task(server.stop(5.0))
        rest = await rest_of(call)
        await stopping
        with pytest.raises(grpc.aio.AioRpcError) as after:
            await method(channel, "Echo")(b"late", timeout=2.0)
    assert rest == [b"%d" % index for index in range(1, 20)]
    assert await call.code() is grpc.StatusCode.OK
    assert after.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_stop_cancels_a_call_still_running_after_the_grace():
    probe = Probe()
    server, address = await started(probe)
    async with grpc.aio.insecure_channel(address) as channel:
        call = method(channel, "Slow")(b"")
        await asyncio.sleep(0.2)
        await server.stop(0.2)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call
    assert probe.cancelled
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_port_is_shared_only_when_reuse_port_is_asked():
    first = H2Server(reuse_port=False)
    port = first.add_insecure_port("127.0.0.1:0")
    with pytest.raises(RuntimeError):
        H2Server(reuse_port=False).add_insecure_port(f"127.0.0.1:{port}")
    shared = H2Server(reuse_port=True)
    shared_port = shared.add_insecure_port("127.0.0.1:0")
    assert H2Server(reuse_port=True).add_insecure_port(f"127.0.0.1:{shared_port}") == shared_port


async def test_two_processes_worth_of_servers_on_one_port_both_answer():
    probes = [Probe(), Probe()]
    servers = [H2Server(reuse_port=True), H2Server(reuse_port=True)]
    port = servers[0].add_insecure_port("127.0.0.1:0")
    for server, probe in zip(servers, probes, strict=True):
        if server is servers[1]:
            server.add_insecure_port(f"127.0.0.1:{port}")
        server.add_generic_rpc_handlers((handlers(probe),))
        await server.start()
    try:
        for _ in range(40):   # each new connection lands on one of them (the kernel's hash)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert await method(channel, "Echo")(b"hi", metadata=(("k", "v"),)) == b"hi"
    finally:
        for server in servers:
            await server.stop(None)
    assert all(probe.metadata for probe in probes), "SO_REUSEPORT spread no connection to one server"


# --- the wire itself: what a client that is not grpc's sees ------------------------------------------

class RawClient:
    """A bare HTTP/2 client: what reaches the wire, without grpc's own deadline and retry handling."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
        self.reader, self.writer, self.address = reader, writer, address
        self.frames: list[h2.Frame] = []
        self._buffer = b""
        self._encoder = hpack.Encoder()

    @classmethod
    async def connect(cls, address: str) -> RawClient:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(h2.PREFACE + h2.settings_frame({}))
        return cls(reader, writer, address)

    def open(self, stream_id: int, name: str, headers: list[tuple[str, str]] | None = None) -> None:
        block = self._encoder.encode([(":method", "POST"), (":scheme", "http"),
                                      (":path", f"/{SERVICE}/{name}"),
                                      (":authority", self.address), ("content-type", "application/grpc"),
                                      ("te", "trailers"), *(headers or [])])
        self.writer.write(h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, block))

    def call(self, stream_id: int, name: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.open(stream_id, name, headers)
        self.writer.write(h2.frame(h2.DATA, h2.END_STREAM, stream_id, h2.grpc_message(body)))

    async def until(self, found: Any) -> h2.Frame:
        """Read frames until one for which `found(frame)` holds; that frame."""
        while True:
            for frame in self.frames:
                if found(frame):
                    return frame
            data = await asyncio.wait_for(self.reader.read(65536), 5.0)
            assert data, "connection closed before the frame looked for"
            got, self._buffer = h2.split_frames(self._buffer + data)
            self.frames += got

    def close(self) -> None:
        self.writer.close()


def ends(stream_id: int) -> Any:
    return lambda frame: frame.stream_id == stream_id and (
        frame.type == h2.RST_STREAM or (frame.type == h2.HEADERS and frame.flags & h2.END_STREAM))


async def test_the_server_ends_a_call_at_its_grpc_timeout_even_when_the_client_does_not():
    probe = Probe()
    async with serving(probe) as (_, address):
        client = await RawClient.connect(address)
        client.call(1, "Slow", [("grpc-timeout", "200m")], b"")
        trailers = await client.until(ends(1))
        await asyncio.wait_for(probe.ended.wait(), 2.0)
        client.close()
    assert trailers.type == h2.HEADERS
    assert dict(hpack.Decoder().decode(trailers.payload))["grpc-status"] == "4"   # DEADLINE_EXCEEDED
    assert probe.cancelled


async def test_a_header_block_longer_than_the_clients_frame_size_is_cut_into_continuations():
    probe = Probe()
    size = 40_000
    async with serving(probe) as (_, address):
        client = await RawClient.connect(address)          # SETTINGS_MAX_FRAME_SIZE: the default 16 KiB
        client.call(1, "BigTrailers", [], b"%d" % size)
        await client.until(lambda frame: frame.stream_id == 1 and frame.type == h2.CONTINUATION
                           and frame.flags & h2.END_HEADERS)
        client.close()
    frames = [frame for frame in client.frames if frame.stream_id == 1]
    assert max(len(frame.payload) for frame in frames) <= h2.DEFAULT_MAX_FRAME
    assert [frame.type for frame in frames] == [h2.HEADERS, h2.CONTINUATION, h2.CONTINUATION]
    block = b"".join(frame.payload for frame in frames)
    assert dict(hpack.Decoder().decode(block))["note"] == "n" * size


async def test_a_stream_opened_after_goaway_on_the_same_connection_is_refused():
    probe = Probe()
    server, address = await started(probe)
    client = await RawClient.connect(address)
    client.call(1, "Slow", [], b"")                  # in progress: the connection stays open to drain it
    await asyncio.sleep(0.2)
    stopping = asyncio.create_task(server.stop(3.0))
    await client.until(lambda frame: frame.type == h2.GOAWAY)
    client.call(3, "Echo", [], b"late")
    refused = await client.until(ends(3))
    client.close()
    await stopping
    assert refused.type == h2.RST_STREAM and h2.parse_u32(refused.payload) == REFUSED_STREAM


def goaway_code(frame: h2.Frame) -> int:
    return h2.parse_u32(frame.payload[4:8])


async def closed(client: RawClient) -> bool:
    """Whether the server closed the connection (read to its end)."""
    while True:
        data = await asyncio.wait_for(client.reader.read(65536), 5.0)
        if not data:
            return True
        got, client._buffer = h2.split_frames(client._buffer + data)
        client.frames += got


async def test_a_frame_longer_than_the_servers_max_frame_size_closes_the_connection_before_its_payload():
    # The server never raises SETTINGS_MAX_FRAME_SIZE from 16,384: a head announcing more is refused at
    # once (FRAME_SIZE_ERROR), without waiting for (and buffering) the megabytes it announces.
    probe = Probe()
    async with serving(probe) as (_, address):
        client = await RawClient.connect(address)
        client.writer.write(bytes([0x10, 0x00, 0x00, h2.DATA, 0, 0, 0, 0, 1]))   # a head announcing 1 MiB
        goaway = await client.until(lambda frame: frame.type == h2.GOAWAY)
        assert await closed(client)
    assert goaway_code(goaway) == 0x6                                            # FRAME_SIZE_ERROR


async def test_a_header_block_that_never_ends_is_refused_once_over_its_bound():
    # CONTINUATIONs without END_HEADERS (the CONTINUATION flood): the block is cut off past 64 KiB, not
    # gathered for ever.
    probe = Probe()
    async with serving(probe) as (_, address):
        client = await RawClient.connect(address)
        chunk = b"\x00" * h2.DEFAULT_MAX_FRAME
        client.writer.write(h2.frame(h2.HEADERS, 0, 1, chunk))
        sent = len(chunk)
        while sent <= h2.MAX_HEADER_BLOCK:
            client.writer.write(h2.frame(h2.CONTINUATION, 0, 1, chunk))
            sent += len(chunk)
        goaway = await client.until(lambda frame: frame.type == h2.GOAWAY)
        assert await closed(client)
    assert goaway_code(goaway) == 0x1                                            # PROTOCOL_ERROR
    assert probe.metadata == ()                                                  # no call was started


async def test_a_call_past_the_advertised_concurrent_streams_is_refused(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(h2server, "MAX_CONCURRENT_STREAMS", 2)
    probe = Probe()
    async with serving(probe) as (_, address):
        client = await RawClient.connect(address)
        settings = await client.until(lambda frame: frame.type == h2.SETTINGS and frame.payload)
        payload = settings.payload
        advertised = {int.from_bytes(payload[i:i + 2], "big"): h2.parse_u32(payload[i + 2:i + 6])
                      for i in range(0, len(payload), 6)}
        client.call(1, "Slow", [], b"")
        client.call(3, "Slow", [], b"")
        client.call(5, "Echo", [], b"third")             # two calls open: one too many
        refused = await client.until(ends(5))
        client.close()
    assert advertised[h2.SETTINGS_MAX_CONCURRENT_STREAMS] == 2
    assert refused.type == h2.RST_STREAM and h2.parse_u32(refused.payload) == REFUSED_STREAM


class RecordingTransport:
    """What a connection hands its socket, one entry per send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.closed = True


async def test_what_several_streams_write_in_one_pass_of_the_loop_goes_out_in_one_send():
    connection = H2Connection(H2Server())
    transport = RecordingTransport()
    connection.connection_made(transport)   # type: ignore[arg-type]
    await asyncio.sleep(0)
    transport.sent.clear()                   # the server's SETTINGS
    frames = [h2.frame(h2.DATA, 0, stream_id, h2.grpc_message(b"event %d" % stream_id))
              for stream_id in (1, 3, 5)]
    for frame in frames:
        connection.write(frame)
    assert transport.sent == []
    await asyncio.sleep(0)
    assert transport.sent == [b"".join(frames)]
    connection.write(b"last")
    connection.close()                       # what is queued goes out before the close
    assert transport.sent[-1] == b"last" and transport.closed


# --- grpc_wire, pure -------------------------------------------------------------------------------

def test_header_blocks_decode_exactly_through_a_standard_hpack_decoder():
    long_value = "v" * 300                     # a length beyond the 7-bit prefix: multi-byte integer
    block = wire.RESPONSE_HEADERS + wire.status_block(
        grpc.StatusCode.NOT_FOUND, "run 'x' not found: 100% sure ✓",
        [("note", long_value), ("raw-bin", b"\xff\x00")])
    decoder = hpack.Decoder()
    assert decoder.decode(block) == [
        (":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "5"),
        ("grpc-message", "run 'x' not found: 100%25 sure %E2%9C%93"), ("note", long_value),
        ("raw-bin", "/wA")]
    assert len(decoder.header_table.dynamic_entries) == 0, "no block may enter the client's dynamic table"
    assert hpack.Decoder().decode(wire.OK_TRAILERS) == [("grpc-status", "0")]


def literal_indexed(name: bytes, value: bytes) -> bytes:
    """A literal that enters the dynamic table (RFC 7541 §6.2.1), new name, no Huffman coding."""
    return b"\x40" + bytes((len(name),)) + name + bytes((len(value),)) + value


def test_a_remembered_header_block_decodes_as_the_dynamic_table_now_says():
    # b"\xbe" names dynamic entry 62, the newest: once a later block inserts another entry, the same
    # bytes name that one, and a block remembered from before would be wrong.
    newest = b"\xbe"
    decoder, reference = wire.HeaderDecoder(), hpack.Decoder()
    blocks = [literal_indexed(b"x-a", b"1"), newest, newest, literal_indexed(b"x-b", b"2"), newest, newest]
    decoded = [decoder.decode(block) for block in blocks]
    assert decoded == [tuple(reference.decode(block, raw=True)) for block in blocks]
    assert decoded[2] == ((b"x-a", b"1"),) and decoded[5] == ((b"x-b", b"2"),)


def test_a_grpc_clients_repeated_request_block_is_decoded_once_and_read_the_same():
    encoder = hpack.Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", "/test.Echo/Echo"), (":authority", "h:1"),
              ("content-type", "application/grpc"), ("te", "trailers"), ("x-api-key", "sk-1")]
    first, again = encoder.encode(fields), encoder.encode(fields)     # the second: table references only
    decoder = wire.HeaderDecoder()
    assert decoder.decode(first) == decoder.decode(again) == decoder.decode(again)
    assert decoder.decode(again) is decoder.decode(again)              # remembered, not decoded again
    assert wire.call_head(decoder.decode(again)).metadata == (("x-api-key", "sk-1"),)


def test_grpc_timeout_units():
    assert wire.timeout_s(b"250m") == pytest.approx(0.25)
    assert wire.timeout_s(b"2S") == 2.0
    assert wire.timeout_s(b"1H") == 3600.0
    assert wire.timeout_s(b"5000000u") == pytest.approx(5.0)
    assert wire.timeout_s(b"123456789S") is None      # more than 8 digits
    assert wire.timeout_s(b"10x") is None


def test_a_request_that_is_not_grpc_is_refused_by_its_head():
    with pytest.raises(ValueError, match="not application/grpc"):
        wire.call_head([(b":method", b"POST"), (b":path", b"/a/b"), (b"content-type", b"text/html")])
    head = wire.call_head([(b":method", b"POST"), (b":path", b"/a/b"),
                           (b"content-type", b"application/grpc+proto"),
                           (b"te", b"trailers"), (b"grpc-timeout", b"100m"), (b"x-key", b"k"),
                           (b"bin-bin", b"AAE")])
    assert (head.path, head.timeout_s, head.metadata, head.encoding) == (
        "/a/b", pytest.approx(0.1), (("x-key", "k"), ("bin-bin", b"\x00\x01")), "identity")
