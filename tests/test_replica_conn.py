"""services/replica_conn.py and h2frames.py: the replica's token streams over one HTTP/2 connection.

A scripted HTTP/2 peer on loopback plays the server frame by frame (the real replica is exercised
through replica_client in test_replica.py); the keepalive is driven with explicit clock values."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import hpack
import pytest
from sluice.services import h2frames as h2
from sluice.services import replica_conn
from sluice.services.replica_conn import ReplicaConnection

PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


@dataclass
class Sink:
    messages: list[bytes] = field(default_factory=list)
    ends: list[tuple[str | None, str]] = field(default_factory=list)

    def message(self, body: bytes) -> None:
        self.messages.append(body)

    def closed(self, code: str | None, details: str) -> None:
        self.ends.append((code, details))


class Peer:
    """The server side of one connection: reads the client's frames, writes what a test scripts."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.buffer = b""

    async def handshake(self, settings: dict[int, int] | None = None) -> None:
        assert await self.reader.readexactly(len(h2.PREFACE)) == h2.PREFACE
        self.writer.write(h2.settings_frame(settings or {}))

    async def next_frame(self, *skip: int) -> h2.Frame:
        """The client's next frame, passing over the types in `skip`."""
        while True:
            frames, rest = h2.split_frames(self.buffer)
            if frames:
                frame = frames[0]
                self.buffer = self.buffer[9 + len(frame.payload):]
                if frame.type in skip:
                    continue
                return frame
            self.buffer = rest + await self.reader.read(65536)

    def headers(self, stream_id: int, headers: list[tuple[str, str]], end_stream: bool = False) -> None:
        flags = h2.END_HEADERS | (h2.END_STREAM if end_stream else 0)
        self.writer.write(h2.frame(h2.HEADERS, flags, stream_id, self.encoder.encode(headers)))

    def data(self, stream_id: int, payload: bytes) -> None:
        self.writer.write(h2.frame(h2.DATA, 0, stream_id, payload))


@contextlib.asynccontextmanager
async def scripted_peers() -> AsyncIterator[tuple[str, asyncio.Queue[Peer]]]:
    """A listener whose every connection is a Peer a test scripts; its address."""
    peers: asyncio.Queue[Peer] = asyncio.Queue()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await peers.put(Peer(reader, writer))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", peers
    finally:
        server.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[ReplicaConnection, asyncio.Queue[Peer]]]:
    async with scripted_peers() as (address, peers):
        connection = await replica_conn.connect(address)
        try:
            yield connection, peers
        finally:
            connection.close()


SETUP = (h2.SETTINGS, h2.WINDOW_UPDATE)   # the client's preface frames


def test_frames_are_cut_where_they_end_and_a_partial_frame_waits_for_the_next_read():
    stream = h2.frame(h2.DATA, 0, 3, b"abc") + h2.frame(h2.PING, h2.ACK, 0, b"12345678")
    frames, rest = h2.split_frames(stream[:-2])
    assert [(f.type, f.flags, f.stream_id, f.payload) for f in frames] == [(h2.DATA, 0, 3, b"abc")]
    frames, rest = h2.split_frames(rest + stream[-2:])
    assert [(f.type, f.payload) for f in frames] == [(h2.PING, b"12345678")] and rest == b""


def test_grpc_messages_are_cut_across_and_within_data_frames():
    one, two, three = h2.grpc_message(b"first"), h2.grpc_message(b""), h2.grpc_message(b"third" * 10)
    reader = h2.MessageReader()
    assert reader.feed(one + two + three[:7]) == [b"first", b""]
    assert reader.pending()
    assert reader.feed(three[7:]) == [b"third" * 10] and not reader.pending()


async def test_a_stream_hands_over_each_message_in_order_then_the_trailers_status(served):
    connection, peers = served
    sink = Sink()
    stream_id = connection.start(PATH, sink)
    await connection.send(stream_id, b"request")
    peer = await peers.get()
    await peer.handshake()
    headers = await peer.next_frame(*SETUP)
    assert headers.type == h2.HEADERS and headers.stream_id == stream_id
    request = await peer.next_frame(*SETUP)
    assert h2.MessageReader().feed(request.payload) == [b"request"]
    peer.headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    both = h2.grpc_message(b"one") + h2.grpc_message(b"two")
    peer.data(stream_id, both + h2.grpc_message(b"three")[:4])
    peer.data(stream_id, h2.grpc_message(b"three")[4:])
    peer.headers(stream_id, [("grpc-status", "14"), ("grpc-message", "going down")], end_stream=True)
    await asyncio.wait_for(_until(lambda: sink.ends), 5)
    assert sink.messages == [b"one", b"two", b"three"]
    assert sink.ends == [("UNAVAILABLE", "going down")] and connection.open_streams == 0


async def test_a_request_larger_than_the_peers_window_waits_for_its_window_updates(served):
    connection, peers = served
    sink = Sink()
    stream_id = connection.start(PATH, sink)
    peer = await peers.get()
    await peer.handshake({h2.SETTINGS_INITIAL_WINDOW_SIZE: 100})
    await peer.next_frame(h2.WINDOW_UPDATE)          # the client's SETTINGS
    assert (await peer.next_frame(h2.WINDOW_UPDATE)).type == h2.HEADERS
    acked = await peer.next_frame()
    assert (acked.type, acked.flags) == (h2.SETTINGS, h2.ACK)   # the window of 100 now applies
    body = bytes(range(256)) * 2                     # 512 bytes + the 5-byte prefix
    sending = asyncio.ensure_future(connection.send(stream_id, body))
    received = b""
    while len(received) < len(body) + 5:
        frame = await peer.next_frame(*SETUP)
        assert frame.type == h2.DATA and len(frame.payload) <= 100
        received += frame.payload
        assert not sending.done() or len(received) == len(body) + 5
        if len(received) % 100 == 0:                 # the window is spent: nothing more until it opens
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(peer.next_frame(*SETUP), 0.1)
            peer.writer.write(h2.window_update(stream_id, 100))
    await asyncio.wait_for(sending, 5)
    assert h2.MessageReader().feed(received) == [body]


async def test_goaway_ends_the_streams_above_its_last_id_and_no_new_stream_starts(served):
    connection, peers = served
    sinks = [Sink(), Sink(), Sink()]
    ids = [connection.start(PATH, sink) for sink in sinks]
    peer = await peers.get()
    await peer.handshake()
    peer.writer.write(h2.frame(h2.GOAWAY, 0, 0, ids[1].to_bytes(4, "big") + (0).to_bytes(4, "big")))
    await asyncio.wait_for(_until(lambda: sinks[2].ends), 5)
    assert sinks[2].ends == [("UNAVAILABLE", replica_conn.ERR_GOAWAY.format(code=0))]
    assert sinks[0].ends == sinks[1].ends == [] and connection.open_streams == 2
    assert not connection.usable
    with pytest.raises(ConnectionError):
        connection.start(PATH, Sink())


async def pinged(connection: ReplicaConnection,
                 peers: asyncio.Queue[Peer]) -> tuple[Sink, Peer, float, h2.Frame]:
    """One stream open and the peer silent since its SETTINGS: `check` sends nothing within
    KEEPALIVE_S of the peer's last word, then a ping (returned, with when the peer last spoke)."""
    sink = Sink()
    connection.start(PATH, sink)
    peer = await peers.get()
    await peer.handshake()
    await asyncio.sleep(0.05)                        # the SETTINGS arrive: the peer's last word
    heard = connection.last_received
    connection.check(heard + replica_conn.KEEPALIVE_S / 2)
    connection.check(heard + replica_conn.KEEPALIVE_S + 0.1)          # silent long enough: a ping
    ping = await asyncio.wait_for(peer.next_frame(*SETUP, h2.HEADERS), 5)
    assert ping.type == h2.PING and not ping.flags & h2.ACK
    return sink, peer, heard, ping


async def test_a_silent_peer_is_pinged_and_its_streams_end_unavailable_when_the_ping_goes_unanswered(served):
    connection, peers = served
    sink, _, heard, _ = await pinged(connection, peers)
    connection.check(heard + replica_conn.KEEPALIVE_S + 0.1 + replica_conn.KEEPALIVE_TIMEOUT_S / 2)
    await asyncio.sleep(0.05)
    assert sink.ends == []                           # still within the ping's timeout
    connection.check(heard + replica_conn.KEEPALIVE_S + 0.2 + replica_conn.KEEPALIVE_TIMEOUT_S)
    await asyncio.wait_for(_until(lambda: sink.ends), 5)
    assert sink.ends == [("UNAVAILABLE", replica_conn.ERR_KEEPALIVE.format(
        seconds=replica_conn.KEEPALIVE_TIMEOUT_S + 0.1))]


async def test_a_ping_answered_keeps_the_connection_and_the_peers_pings_are_answered(served):
    connection, peers = served
    sink, peer, _, ping = await pinged(connection, peers)
    peer.writer.write(h2.frame(h2.PING, h2.ACK, 0, ping.payload) + h2.frame(h2.PING, 0, 0, b"peer-png"))
    answer = await asyncio.wait_for(peer.next_frame(*SETUP), 5)
    assert (answer.type, answer.flags, answer.payload) == (h2.PING, h2.ACK, b"peer-png")
    connection.check(connection.last_received + replica_conn.KEEPALIVE_TIMEOUT_S / 2)
    assert sink.ends == [] and connection.usable


async def _until(condition, step: float = 0.01) -> None:
    """Poll a sink filled from the connection's callbacks (nothing there to wait on)."""
    for _ in range(int(5 / step)):
        if condition():
            return
        await asyncio.sleep(step)


async def test_every_streams_request_headers_decode_whole_and_leave_the_peers_table_empty(served):
    connection, peers = served
    other = "/inference.GRPCInferenceService/ModelReady"
    ids = [connection.start(path, Sink()) for path in (PATH, other, PATH)]
    peer = await peers.get()
    await peer.handshake()
    decoder = hpack.Decoder()
    for stream_id, path in zip(ids, (PATH, other, PATH), strict=True):
        block = await peer.next_frame(*SETUP)
        assert block.type == h2.HEADERS and block.stream_id == stream_id
        assert decoder.decode(block.payload) == [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", connection.address),
            ("content-type", "application/grpc"), ("te", "trailers")]
        assert len(decoder.header_table.dynamic_entries) == 0     # nothing indexed: one block per path


async def test_a_peer_that_shrinks_its_header_table_has_it_acknowledged_in_the_next_block(served):
    connection, peers = served
    connection.start(PATH, Sink())
    peer = await peers.get()
    await peer.handshake({h2.SETTINGS_HEADER_TABLE_SIZE: 0})
    decoder = hpack.Decoder()
    first = await peer.next_frame(*SETUP)
    decoder.decode(first.payload)
    while not (await peer.next_frame(h2.WINDOW_UPDATE)).flags & h2.ACK:   # our SETTINGS ACKed
        pass
    decoder.max_allowed_table_size = 0
    connection.start(PATH, Sink())
    second = await peer.next_frame(*SETUP)
    assert second.payload[0] & 0xE0 == 0x20          # a dynamic table size update opens the block
    assert dict(decoder.decode(second.payload))[":path"] == PATH


class RecordingTransport:
    """The connection's transport, recording the sends made on it and when reading paused and resumed."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []
        self.calls: list[str] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def pause_reading(self) -> None:
        self.calls.append("pause")
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.calls.append("resume")
        self.transport.resume_reading()

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)


async def test_what_one_loop_pass_writes_leaves_in_one_send_in_order(served):
    connection, peers = served
    counting = connection._transport = RecordingTransport(connection._transport)  # type: ignore[assignment]
    ids = []
    for body in (b"one", b"two", b"three"):                # a claim pass starting three runs
        ids.append(connection.start(PATH, Sink()))
        await connection.send(ids[-1], body)               # the window is open: no wait
    assert counting.writes == []
    await asyncio.sleep(0)
    assert len(counting.writes) == 1
    peer = await peers.get()
    await peer.handshake()
    frames = [await peer.next_frame(*SETUP) for _ in range(6)]
    assert [(f.type, f.stream_id) for f in frames] == [(kind, stream_id) for stream_id in ids
                                                       for kind in (h2.HEADERS, h2.DATA)]
    assert [h2.MessageReader().feed(f.payload)[0] for f in frames[1::2]] == [b"one", b"two", b"three"]


async def test_closing_sends_what_was_written_before_it(served):
    connection, peers = served
    stream_id = connection.start(PATH, Sink())
    connection.cancel(stream_id)
    connection.close()
    peer = await peers.get()
    await peer.handshake()
    assert (await peer.next_frame(*SETUP)).type == h2.HEADERS
    reset = await peer.next_frame(*SETUP)
    assert (reset.type, reset.stream_id, h2.parse_u32(reset.payload)) == (h2.RST_STREAM, stream_id, h2.CANCEL)


async def test_header_blocks_repeated_on_every_stream_are_decoded_once_per_connection(served, monkeypatch):
    # Every stream's response headers and trailers are the same; after the first stream's (literals
    # that enter the peer's table) the peer sends them as references, the same bytes each time.
    decoded: list[bytes] = []
    decode = hpack.Decoder.decode

    def counted(self, data, raw=False):  # type: ignore[no-untyped-def]
        decoded.append(bytes(data))
        return decode(self, data, raw)

    monkeypatch.setattr(hpack.Decoder, "decode", counted)
    connection, peers = served
    sinks = [Sink() for _ in range(4)]
    peer: Peer | None = None
    for sink in sinks:
        stream_id = connection.start(PATH, sink)
        if peer is None:
            peer = await peers.get()
            await peer.handshake()
        peer.headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        peer.data(stream_id, h2.grpc_message(b"token"))
        peer.headers(stream_id, [("grpc-status", "0"), ("grpc-message", "")], end_stream=True)
        await asyncio.wait_for(_until(lambda: sink.ends), 5)  # noqa: B023
    assert [sink.ends for sink in sinks] == [[(None, "")]] * 4
    assert [sink.messages for sink in sinks] == [[b"token"]] * 4
    # The first stream's two blocks (literals), the second's (references), then none.
    assert len(decoded) == 4 and len(set(decoded)) == 4


async def test_windows_are_topped_up_once_what_was_received_on_them_reaches_the_refill_mark(
        served, monkeypatch):
    monkeypatch.setattr(h2, "WINDOW_REFILL", 64)
    connection, peers = served
    sink = Sink()
    stream_id = connection.start(PATH, sink)
    peer = await peers.get()
    await peer.handshake()
    message = h2.grpc_message(b"x" * 25)             # 30 bytes a frame
    for _ in range(3):
        peer.data(stream_id, message)
    # 90 bytes received: past the mark on the third frame, on the connection and on the stream.
    preface = (h2.WINDOW_UPDATE, 0, h2.MAX_WINDOW - h2.DEFAULT_WINDOW)   # the client opening its window
    updates = [await asyncio.wait_for(peer.next_frame(h2.SETTINGS, h2.HEADERS), 5) for _ in range(3)]
    expected = [preface, (h2.WINDOW_UPDATE, 0, 90), (h2.WINDOW_UPDATE, stream_id, 90)]
    got = [(frame.type, frame.stream_id, h2.parse_u32(frame.payload)) for frame in updates]
    assert sorted(got) == sorted(expected)
    await asyncio.wait_for(_until(lambda: len(sink.messages) == 3), 5)


async def test_a_read_close_behind_the_last_pauses_reading_for_the_pace_and_a_sparse_one_does_not(
        served, monkeypatch):
    connection, peers = served
    sink = Sink()
    stream_id = connection.start(PATH, sink)
    peer = await peers.get()
    await peer.handshake()
    peer.headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    peer.data(stream_id, h2.grpc_message(b"0"))
    await asyncio.wait_for(_until(lambda: sink.messages == [b"0"]), 5)
    pacing = connection._transport = RecordingTransport(connection._transport)  # type: ignore[assignment]
    clock = [1000.0]
    monkeypatch.setattr(replica_conn, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    connection.last_received = 0.0

    def read(body: bytes) -> None:                      # one read of the socket carrying one DATA frame
        connection.data_received(h2.frame(h2.DATA, 0, stream_id, h2.grpc_message(body)))

    read(b"1")                                          # long after the last read: handled, not paced
    assert pacing.calls == [] and sink.messages == [b"0", b"1"]
    clock[0] += replica_conn.READ_PACE_S / 2
    read(b"2")                                          # dense: handled, then reading paused
    assert pacing.calls == ["pause"] and sink.messages[-1] == b"2"
    await asyncio.sleep(replica_conn.READ_PACE_S * 3)
    assert pacing.calls == ["pause", "resume"]          # the pace over, the socket is read again
    clock[0] += 1.0
    read(b"3")
    assert pacing.calls == ["pause", "resume"] and sink.messages == [b"0", b"1", b"2", b"3"]
