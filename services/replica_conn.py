"""One plaintext HTTP/2 connection to a replica, carrying many gRPC streams, on the event loop itself.

Why not grpc.aio for the token streams (issue 9.1): grpc.aio hands every received message from
gRPC core's threads to the event loop one at a time (a completion, an eventfd kick, a byte written
to wake the loop, a future and a task step per message), ~85 us of CPU per token measured at 64
streams (bench/bench_data_path.py). Here one `data_received` call parses every frame the socket
delivered: the responses of all the streams a replica step produced arrive together and are
handed to each stream's sink by a plain call, no thread, no future, no task per message.

What it implements of RFC 9113, and only that: the client preface and SETTINGS (acknowledged,
the peer's initial window, frame size and header table size honoured), HEADERS/CONTINUATION
through hpack (every block is decoded, in order, to keep the decoder's table in step), DATA cut
into gRPC messages (h2frames.MessageReader), flow control both ways (this side opens its windows
wide and refills them; a large request waits for the peer's window), RST_STREAM, PING (answered;
sent by `check` when the connection went silent: a peer that vanished without closing is found
within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S), GOAWAY (streams above its last id end, new streams go
to a new connection). No TLS (replica_client keeps grpc.aio for TLS replicas), no compression, no
server push (refused in SETTINGS).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Protocol, cast

import hpack
from sluice.services import h2frames as h2
from sluice.services.grpc_wire import HeaderDecoder

KEEPALIVE_S = 2.0            # silence on a connection with open streams before it is pinged
KEEPALIVE_TIMEOUT_S = 2.0    # an unanswered ping then closes it: every stream on it is lost
MAX_STREAM_ID = 2**31 - 1
# A replica writes each token of each stream as its own response, so at 64 streams a connection had
# about one read (a loop wake-up, a recv, a parse pass) per token. A read that follows the previous
# one within READ_PACE_S stops reading the socket for READ_PACE_S: what arrives meanwhile waits in
# the kernel and comes in one read (bench_data_path, 64 streams x 100 tokens: reads per token
# 0.79 -> 0.27, CPU per token 69-82 -> 51-56 us). Sparse traffic (a run alone, its first token) is
# read at once; under dense traffic a response waits at most READ_PACE_S, against DELTA windows of
# coalesce_ms (200 by default).
READ_PACE_S = 0.003

ERR_HTTP_STATUS = "HTTP status {status}"
ERR_RESET = "stream reset by the replica (HTTP/2 error {code})"
ERR_NO_TRAILERS = "stream ended without trailers"
ERR_GOAWAY = "the replica is going away (HTTP/2 GOAWAY, error {code})"
ERR_KEEPALIVE = "keepalive ping unanswered for {seconds:.1f}s"
ERR_CLOSED = "connection closed"
ERR_PROTOCOL = "protocol error: {why}"


class StreamSink(Protocol):
    """What a stream's owner is told. Both are called on the event loop, from data_received."""

    def message(self, body: bytes) -> None:
        """One gRPC message of the stream, in order."""

    def closed(self, code: str | None, details: str) -> None:
        """The stream ended: code None when the server ended it with grpc-status 0, else a gRPC
        status name (UNAVAILABLE when the connection went away) and why. Called once, last."""


@dataclass(slots=True, eq=False)
class _Stream:
    sink: StreamSink
    reader: h2.MessageReader
    send_window: int                       # what the peer lets this stream send
    received: int = 0                      # bytes since this stream's window was last topped up


_GRPC_CODE_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                    "UNAUTHENTICATED")


def grpc_code_name(status: bytes | None) -> str:
    """A grpc-status header's value as its name (UNKNOWN when absent or not a number)."""
    try:
        return _GRPC_CODE_NAMES[int(status or b"")]
    except (ValueError, IndexError):
        return "UNKNOWN"


class ReplicaConnection(asyncio.Protocol):
    """Use `connect`; then `start` streams, `send` on them, `cancel` them; call `check` now and then
    (keepalive)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.usable = True                  # False once lost or told GOAWAY: new streams go elsewhere
        self.last_received = time.monotonic()
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._streams: dict[int, _Stream] = {}
        self._next_id = 1
        self._encoder = hpack.Encoder()
        # (path, metadata) -> request headers (_request_block)
        self._request_blocks: dict[tuple[str, tuple[tuple[str, str], ...]], bytes] = {}
        self._out: list[bytes] = []                # written this loop pass, sent at its end (_write)
        self._loop = asyncio.get_running_loop()    # made on the loop it serves (connect)
        self._table_shrunk = False                 # the peer's header table is below the default
        # Every stream's response headers and trailers repeat the same blocks: each decoded once.
        self._decoder = HeaderDecoder()
        self._blocks = h2.HeaderBlocks()
        self._send_window = h2.DEFAULT_WINDOW      # the connection's, set by the peer
        self._peer_initial = h2.DEFAULT_WINDOW     # each new stream's, set by the peer
        self._max_frame = h2.DEFAULT_MAX_FRAME
        self._received = 0
        self._ping_sent_at: float | None = None
        self._window_opened = asyncio.Event()
        self._lost: str | None = None              # why the connection is gone

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)   # uvloop's is not a subclass of it
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._transport.write(h2.PREFACE
                        + h2.settings_frame({h2.SETTINGS_ENABLE_PUSH: 0,
                                             h2.SETTINGS_INITIAL_WINDOW_SIZE: h2.MAX_WINDOW})
                        + h2.window_update(0, h2.MAX_WINDOW - h2.DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        if self._lost is None:
            self._lost = str(exc) if exc is not None else ERR_CLOSED
        self._window_opened.set()           # a sender waiting for window sees the loss
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.sink.closed("UNAVAILABLE", self._lost)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        dense = now - self.last_received < READ_PACE_S
        self.last_received = now
        self._ping_sent_at = None           # anything received proves the peer alive
        buffer = self._buffer + data if self._buffer else data
        try:
            self._buffer = buffer[self._on_frames(buffer):]
        except (hpack.HPACKError, ValueError, KeyError) as exc:
            self._fail(ERR_PROTOCOL.format(why=exc))
        transport = self._transport
        if dense and transport is not None and not transport.is_closing():
            transport.pause_reading()       # READ_PACE_S: the next read gathers what comes meanwhile
            self._loop.call_later(READ_PACE_S, self._resume_reading)

    def _resume_reading(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _on_frames(self, buffer: bytes) -> int:
        """Handle every complete frame of `buffer`, in one pass; returns where the incomplete rest
        begins. DATA, nearly every frame a replica sends (one per token of every stream), goes
        straight to its stream without a Frame built for it."""
        pos, size = 0, len(buffer)
        unpack_head = h2.unpack_head
        blocks_open = self._blocks.open      # changes only with a HEADERS or CONTINUATION frame
        while size - pos >= 9:
            high, low, kind, flags, stream_id = unpack_head(buffer, pos)
            start = pos + 9
            end = start + (high << 16 | low)
            if end > size:
                break
            pos = end
            if kind == h2.DATA and not blocks_open:
                self._on_data(stream_id & 0x7FFFFFFF, flags, buffer[start:end])
            else:
                self._on_frame(h2.Frame(kind, flags, stream_id & 0x7FFFFFFF, buffer[start:end]))
                blocks_open = self._blocks.open
        return pos

    # --- streams --------------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def start(self, path: str, sink: StreamSink, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """Open a stream of the RPC at `path` (its HEADERS go out now, with `metadata`: lowercase
        names, as gRPC's) and return its id; the sink hears every message and the end. Raises
        ConnectionError if the connection is unusable."""
        if not self.usable or self._transport is None:
            raise ConnectionError(self._lost or ERR_CLOSED)
        stream_id = self._next_id
        self._next_id += 2
        if self._next_id > MAX_STREAM_ID:
            self.usable = False             # ids run out: the next stream opens a new connection
        block = self._request_blocks.get((path, metadata)) or self._request_block(path, metadata)
        self._streams[stream_id] = _Stream(sink, h2.MessageReader(), self._peer_initial)
        self._write(h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, block))
        return stream_id

    async def send(self, stream_id: int, body: bytes, *, last: bool = False) -> None:
        """Send `body` as one gRPC message on the stream, which stays open for writing (as grpc.aio's
        stream-stream calls leave it) unless it is the `last` (a unary call's request: END_STREAM). A
        stream ended meanwhile takes nothing; a lost connection raises ConnectionError (its streams'
        sinks were told)."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            await self._send(stream_id, stream, h2.grpc_message(body), h2.END_STREAM if last else 0)

    def cancel(self, stream_id: int) -> None:
        """Drop the stream (RST_STREAM CANCEL); its sink hears nothing more."""
        if self._streams.pop(stream_id, None) is not None and self._transport is not None \
                and not self._transport.is_closing():
            self._write(h2.rst_stream(stream_id))
        self._close_if_drained()

    def check(self, now: float) -> None:
        """Keepalive (the loop's sweeper calls it): ping a silent connection that has open streams,
        and close it if the ping goes unanswered."""
        if not self._streams or self._transport is None:
            return
        if self._ping_sent_at is not None:
            if now - self._ping_sent_at > KEEPALIVE_TIMEOUT_S:
                self._fail(ERR_KEEPALIVE.format(seconds=now - self._ping_sent_at))
        elif now - self.last_received > KEEPALIVE_S:
            self._ping_sent_at = now
            self._write(h2.frame(h2.PING, 0, 0, b"\0" * 8))

    def close(self) -> None:
        self.usable = False
        if self._transport is not None:
            self._flush()
            self._transport.close()

    # --- internals ------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Queue `data` for the socket: what one pass of the event loop writes on the connection goes
        out in one send (a claim pass starts several streams, each a HEADERS and a DATA frame: a
        system call each, written at once)."""
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(out))

    def _request_block(self, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
        """A stream's request headers. Written as literals that reference only HPACK's static table
        (never indexed), they add nothing to the peer's dynamic table, so one block per path (and
        metadata) serves every stream of the connection (encoding them per stream cost ~60 us). Once
        the peer shrinks its table below the default, which this side must acknowledge in its next
        block, the encoder takes over."""
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self.address),
                   ("content-type", "application/grpc"), ("te", "trailers"), *metadata]
        if self._table_shrunk:
            return bytes(self._encoder.encode(headers))
        block = self._request_blocks[(path, metadata)] = bytes(hpack.Encoder().encode(
            [hpack.NeverIndexedHeaderTuple(name, value) for name, value in headers]))
        return block

    async def _send(self, stream_id: int, stream: _Stream, data: bytes, end: int = 0) -> None:
        """DATA frames within the peer's windows and frame size (a long prompt may wait for room); the
        last one carries `end` (END_STREAM or 0)."""
        view = memoryview(data)
        while view:
            if self._lost is not None or self._transport is None:
                raise ConnectionError(self._lost or ERR_CLOSED)
            if self._streams.get(stream_id) is not stream:
                return                       # reset meanwhile: nothing more to send
            room = min(self._send_window, stream.send_window, self._max_frame, len(view))
            if room <= 0:
                self._window_opened.clear()
                await self._window_opened.wait()
                continue
            self._write(h2.frame(h2.DATA, end if room == len(view) else 0, stream_id, bytes(view[:room])))
            self._send_window -= room
            stream.send_window -= room
            view = view[room:]

    def _on_frame(self, frame: h2.Frame) -> None:
        kind = frame.type
        if self._blocks.takes(frame):
            block = self._blocks.add(frame)
            if block is not None:
                self._on_headers(block)
        elif kind == h2.DATA:
            self._on_data(frame.stream_id, frame.flags, frame.payload)
        elif kind == h2.RST_STREAM:
            self._end(frame.stream_id, "UNAVAILABLE" if h2.parse_u32(frame.payload) == 7 else "INTERNAL",
                      ERR_RESET.format(code=h2.parse_u32(frame.payload)))
        elif kind == h2.SETTINGS:
            if not frame.flags & h2.ACK:
                self._on_settings(h2.parse_settings(frame.payload))
        elif kind == h2.PING:
            if not frame.flags & h2.ACK and self._transport is not None:
                self._write(h2.frame(h2.PING, h2.ACK, 0, frame.payload))
        elif kind == h2.GOAWAY:
            self._on_goaway(*h2.parse_goaway(frame.payload))
        elif kind == h2.WINDOW_UPDATE:
            increment = h2.parse_u32(frame.payload)
            if frame.stream_id == 0:
                self._send_window += increment
            elif (stream := self._streams.get(frame.stream_id)) is not None:
                stream.send_window += increment
            self._window_opened.set()
        elif kind == h2.PUSH_PROMISE:
            raise ValueError("PUSH_PROMISE after SETTINGS_ENABLE_PUSH 0")
        # PRIORITY and unknown frame types are ignored (RFC 9113 §4.1, §5.5).

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        size = len(payload)
        stream = self._streams.get(stream_id)
        # The windows are opened wide and topped up rarely (h2.refill): counted inline, per frame.
        received = self._received + size
        refill = h2.WINDOW_REFILL
        if received >= refill or (stream is not None and stream.received + size >= refill):
            self._received, update = h2.refill(self._received, size, 0)
            if stream is not None:
                stream.received, more = h2.refill(stream.received, size, stream_id)
                update += more
            if update:
                self._write(update)
        else:
            self._received = received
            if stream is not None:
                stream.received += size
        if stream is None:
            return                           # cancelled here: its late frames only count for the window
        if flags & h2.PADDED:
            payload = h2.unpadded(h2.Frame(h2.DATA, flags, stream_id, payload))
        sink = stream.sink
        for body in stream.reader.feed(payload):
            sink.message(body)
            if self._streams.get(stream_id) is not stream:
                return                       # the sink cancelled the stream
        if flags & h2.END_STREAM:
            self._end(stream_id, "INTERNAL", ERR_NO_TRAILERS)

    def _on_headers(self, block: h2.HeaderBlock) -> None:
        headers = dict(self._decoder.decode(block.data))
        if block.stream_id not in self._streams:
            return
        status = headers.get(b":status")
        if status is not None and status != b"200":
            self._end(block.stream_id, "UNAVAILABLE" if status in (b"502", b"503", b"504") else "UNKNOWN",
                      ERR_HTTP_STATUS.format(status=status.decode(errors="replace")))
        elif block.end_stream:               # trailers, or a trailers-only response
            grpc_status = headers.get(b"grpc-status")
            self._end(block.stream_id, None if grpc_status == b"0" else grpc_code_name(grpc_status),
                      headers.get(b"grpc-message", b"").decode(errors="replace"))

    def _on_settings(self, settings: dict[int, int]) -> None:
        initial = settings.get(h2.SETTINGS_INITIAL_WINDOW_SIZE)
        if initial is not None:
            for stream in self._streams.values():
                stream.send_window += initial - self._peer_initial
            self._peer_initial = initial
        self._max_frame = settings.get(h2.SETTINGS_MAX_FRAME_SIZE, self._max_frame)
        if (table := settings.get(h2.SETTINGS_HEADER_TABLE_SIZE)) is not None:
            self._encoder.header_table_size = table
            if table < h2.DEFAULT_HEADER_TABLE:
                self._table_shrunk = True
                self._request_blocks.clear()
        assert self._transport is not None, "frames arrive on a connected transport"
        self._write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        self._window_opened.set()

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.usable = False
        for stream_id in [sid for sid in self._streams if sid > last_stream_id]:
            self._end(stream_id, "UNAVAILABLE", ERR_GOAWAY.format(code=code))
        self._close_if_drained()

    def _end(self, stream_id: int, code: str | None, details: str) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.sink.closed(code, details)
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if not self.usable and not self._streams and self._transport is not None:
            self._flush()
            self._transport.close()

    def _fail(self, why: str) -> None:
        """Give up on the connection: every open stream ends UNAVAILABLE with `why`."""
        self._lost = why
        self.usable = False
        if self._transport is not None:
            self._transport.abort()          # connection_lost follows and ends the streams


async def connect(address: str) -> ReplicaConnection:
    """A new connection to `address` ("host:port"); raises OSError when it cannot be made."""
    host, _, port = address.rpartition(":")
    _, connection = await asyncio.get_running_loop().create_connection(
        lambda: ReplicaConnection(address), host.strip("[]"), int(port))
    return connection
