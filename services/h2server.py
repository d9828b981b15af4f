"""A gRPC server on the event loop itself: plaintext HTTP/2 in Python, for the gateway's services.

Why not grpc.aio (issue 9): grpc.aio hands every call and every streamed message between gRPC
core's threads and the event loop (a completion, a byte written to wake the loop, a future and a
task step each), ~370 us of server CPU per streamed message when a gateway's events arrive one at
a time, and ~0.4 ms per unary call (bench/bench_grpc_server.py). Here one `data_received` parses
every frame the socket delivered; a response's HEADERS, DATA and trailers go out in one write.

It serves the handlers grpc's own registration produces (`grpc.RpcMethodHandler`, through
`add_generic_rpc_handlers` / `add_registered_method_handlers`, as the generated
`add_…Servicer_to_server` and services/validation.add_checked_service call them), with the
grpc.aio servicer context the services use (`invocation_metadata`, `abort`, `set_code`,
`set_details`, `set_trailing_metadata`, `write`, `time_remaining`, `peer`). All four call shapes
(the health Watch writes through the context; reflection streams requests).

What it implements of RFC 9113 and gRPC's PROTOCOL-HTTP2, and only that: the preface and SETTINGS
(acknowledged; the peer's initial window and frame size honoured), HEADERS/CONTINUATION through
hpack (every block decoded in order, keeping the decoder's table in step), requests cut into gRPC
messages (h2frames.MessageReader, at most MAX_RECEIVE_BYTES a message, as grpc's default), flow
control both ways (windows opened wide and refilled for requests; a response waits for the
client's window, and for the transport's buffer to drain), grpc-timeout (DEADLINE_EXCEEDED, the
handler cancelled), RST_STREAM (the handler cancelled), PING (answered), GOAWAY on stop (calls in
progress finish within the grace; later streams are refused). Status, message (percent-encoded)
and trailing metadata (`-bin` base64) in trailers, trailers-only when nothing was sent. No TLS
(services/main.py keeps grpc.aio for TLS); requests compressed with gzip or deflate are inflated
(at most MAX_RECEIVE_BYTES each), responses go out uncompressed; no server push.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import time
import zlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import grpc.aio
import hpack
from sluice.services import grpc_wire as wire
from sluice.services import h2frames as h2

log = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 4 * 1024 * 1024    # grpc's default max_receive_message_length
# Calls open at once on one connection (advertised; one more is refused, RFC 9113 §5.1.2). With the
# per-message limit it bounds what one connection can make the server hold; grpc's clients queue calls
# beyond it rather than fail them.
MAX_CONCURRENT_STREAMS = 4096
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM = 0x0, 0x1, 0x3, 0x6, 0x7
# Every stream's receive window (our SETTINGS_INITIAL_WINDOW_SIZE). A request-streaming call gets its
# window back as its handler reads (the queue drained), so what a client can send ahead of a handler
# that does not read is one window (plus the message that crossed it); a unary call's is given back on
# receipt, its request being bounded by MAX_RECEIVE_BYTES and any further message dropped.
STREAM_WINDOW = 1 << 20

ERR_UNIMPLEMENTED = "Method not found!"                     # grpc's own text
ERR_ENCODING = "grpc-encoding {encoding!r} is not accepted here: send identity, gzip or deflate"
ERR_UNDECLARED = "a compressed message without a grpc-encoding"
ERR_INFLATE = "a compressed message that does not inflate ({error})"
ERR_TOO_LARGE = "Received message larger than max ({size} vs. {limit})"
ERR_NO_REQUEST = "the call ended without its request message"
ERR_DESERIALIZE = "Exception deserializing request!"        # grpc's own text
ERR_DEADLINE = "Deadline Exceeded"
ERR_SHUTDOWN = "the server is shutting down"
ERR_UNEXPECTED = "Unexpected {kind}: {error}"


@dataclass(frozen=True, slots=True)
class _CallDetails:
    """What a generic handler's `service()` is asked with (grpc.HandlerCallDetails)."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class _Closed(Exception):
    """The call's stream or connection went away: nothing more can be sent on it."""


class Call:
    """One RPC on a connection, and the servicer context its handler is given."""

    def __init__(self, connection: H2Connection, stream_id: int, head: wire.CallHead,
                 handler: grpc.RpcMethodHandler) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self._head = head
        self.handler = handler
        self.reader = h2.MessageReader()
        self.inflate = wire.decompressor(head.encoding, MAX_RECEIVE_BYTES)
        self.send_window = connection.peer_initial_window
        self.unacked = 0                                 # bytes received, not yet given back (WINDOW_UPDATE)
        self.request: Any = None                         # a unary request, once whole
        self.requests: asyncio.Queue[Any] | None = (     # a streamed request's messages (None: the end)
            asyncio.Queue() if handler.request_streaming else None)
        self.half_closed = False                         # the client ended its side (END_STREAM)
        self.task: asyncio.Task[None] | None = None
        self._headers_sent = False
        self._finished = False
        self._reset = False                              # the client reset the stream
        self._deadline_hit = False
        self._deadline = None if head.timeout_s is None else time.monotonic() + head.timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._code = grpc.StatusCode.OK
        self._details: str | None = None
        self._trailing: Sequence[tuple[str, str | bytes]] = ()
        self._initial: Sequence[tuple[str, str | bytes]] = ()

    # --- grpc.aio.ServicerContext, as far as servicers use it -----------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._head.metadata

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> None:
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError(f"aborted with {code.name}")

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._trailing = tuple(trailing_metadata)

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._initial = tuple(initial_metadata)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._connection.peer

    def cancelled(self) -> bool:
        return self._reset or self._deadline_hit

    def done(self) -> bool:
        return self._finished

    async def write(self, message: Any) -> None:
        """Send one response message (a streaming handler that writes instead of yielding)."""
        await self._send(self._serialized(message))

    async def read(self) -> Any:
        """The next request message of a client-streaming call (grpc.aio.EOF at its end)."""
        assert self.requests is not None, "read() on a call whose request is not streamed"
        item = await self.requests.get()
        if self.requests.empty() and (update := self.window_update()):
            with contextlib.suppress(_Closed):
                self._connection.write(update)
        return grpc.aio.EOF if item is None else item

    def received(self, size: int) -> bytes:
        """`size` flow-controlled bytes arrived (after what they complete was queued): the WINDOW_UPDATE
        to send now, if any. A streaming call's messages hold their window until its handler reads."""
        self.unacked += size
        if self.requests is not None and not self.requests.empty():
            return b""
        return self.window_update()

    def window_update(self) -> bytes:
        """The stream's window topped up once half of it is used (not one update per message)."""
        if self.unacked < STREAM_WINDOW // 2 or self.half_closed or self._finished:
            return b""
        update, self.unacked = h2.window_update(self.stream_id, self.unacked), 0
        return update

    # --- driving the handler --------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._connection.server.call_started()
        self.task = loop.create_task(self._run())
        if self._deadline is not None:
            remaining = max(0.0, self._deadline - time.monotonic())
            self._timer = loop.call_at(loop.time() + remaining, self._expire)

    def request_message(self, body: bytes) -> None:
        """A whole request message arrived (called from data_received)."""
        deserializer = self.handler.request_deserializer
        if self.requests is not None:
            self.requests.put_nowait(deserializer(body) if deserializer else body)
            return
        if self.task is not None or self.request is not None:
            return                                       # a unary call's extra message: ignored
        try:
            self.request = deserializer(body) if deserializer else body
        except Exception:
            self.finish(grpc.StatusCode.INTERNAL, ERR_DESERIALIZE)
            return
        self.start()

    def peer_ended(self) -> None:
        """END_STREAM from the client."""
        self.half_closed = True
        if self.requests is not None:
            self.requests.put_nowait(None)
        elif self.task is None and not self._finished:
            self.finish(grpc.StatusCode.INTERNAL, ERR_NO_REQUEST)

    def peer_reset(self) -> None:
        """RST_STREAM from the client, or its connection lost: the handler is cancelled, nothing is sent."""
        self._reset = True
        self._finished = True
        self._stop_timer()
        if self.task is not None:
            self.task.cancel()

    def _expire(self) -> None:
        self._deadline_hit = True
        if self.task is not None and not self._finished:
            self.task.cancel()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _run(self) -> None:
        handler = self.handler
        try:
            if handler.response_streaming:
                behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
                result = behavior(self._request_stream() if handler.request_streaming else self.request, self)
                if inspect.isasyncgen(result):
                    try:
                        async for item in result:
                            await self._send(self._serialized(item))
                    finally:
                        await result.aclose()        # cancelled while sending: its finally runs now
                elif inspect.isgenerator(result):    # a plain (synchronous) generator
                    for item in result:
                        await self._send(self._serialized(item))
                else:
                    await result                     # a handler that writes through the context
                self.finish(self._code, self._details)
                return
            behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
            response = behavior(self._request_stream() if handler.request_streaming else self.request, self)
            if inspect.isawaitable(response):
                response = await response
            if response is not None and self._code is grpc.StatusCode.OK:
                await self._respond(self._serialized(response))
            else:
                self.finish(self._code, self._details)
        except grpc.aio.AbortError:
            self.finish(self._code, self._details)
        except asyncio.CancelledError:
            if self._deadline_hit:
                self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, ERR_DEADLINE)
            elif not self._reset:
                self.finish(grpc.StatusCode.UNAVAILABLE, ERR_SHUTDOWN)
        except _Closed:
            pass
        except Exception as error:                   # grpc.aio answers UNKNOWN with the same text
            log.exception("%s failed", self._head.path)
            self.finish(grpc.StatusCode.UNKNOWN, ERR_UNEXPECTED.format(kind=type(error), error=error))
        finally:
            self._stop_timer()
            self._connection.call_done(self)

    def _serialized(self, message: Any) -> bytes:
        serialize = self.handler.response_serializer
        return cast(bytes, serialize(message) if serialize else message)

    async def _request_stream(self) -> AsyncIterator[Any]:
        while (item := await self.read()) is not grpc.aio.EOF:
            yield item

    # --- sending ----------------------------------------------------------------------------------

    def _head_block(self) -> bytes:
        self._headers_sent = True
        return wire.RESPONSE_HEADERS + (wire.metadata_block(self._initial) if self._initial else b"")

    async def _send(self, body: bytes) -> None:
        """One response message: the response headers first if not yet sent, then DATA within the
        client's windows (waiting for room), after the transport's buffer drained."""
        connection = self._connection
        if self._finished:
            raise _Closed()
        data = h2.grpc_message(body)
        prefix = connection.headers(self.stream_id, self._head_block()) \
            if not self._headers_sent else b""
        if connection.writable(self, len(data)):
            connection.write(prefix + h2.frame(h2.DATA, 0, self.stream_id, data))
            self.send_window -= len(data)
            connection.send_window -= len(data)
            return
        if prefix:
            connection.write(prefix)
        await connection.send_data(self, data)

    async def _respond(self, body: bytes) -> None:
        """A unary call's response and trailers, in one write when the client's windows have room."""
        if self._connection.writable(self, len(body) + 5):
            self.finish(self._code, self._details, body)
            return
        await self._send(body)                       # larger than the window (rare): as room opens
        self.finish(self._code, self._details)

    def finish(self, code: grpc.StatusCode, details: str | None, response: bytes | None = None) -> None:
        """End the call: its last message (a unary response the windows have room for) and trailers
        in one write; trailers alone when nothing was sent (trailers-only). A reset stream sends
        nothing."""
        if self._finished:
            return
        self._finished = True
        self._stop_timer()
        connection = self._connection
        status = wire.status_block(code, details, self._trailing)
        if self._headers_sent:
            out = connection.headers(self.stream_id, status, end_stream=True)
        elif response is None:
            out = connection.headers(self.stream_id, self._head_block() + status, end_stream=True)
        else:
            data = h2.grpc_message(response)
            self.send_window -= len(data)
            connection.send_window -= len(data)
            out = (connection.headers(self.stream_id, self._head_block())
                   + h2.frame(h2.DATA, 0, self.stream_id, data)
                   + connection.headers(self.stream_id, status, end_stream=True))
        if not self.half_closed:
            out += h2.rst_stream(self.stream_id, NO_ERROR)   # RFC 9113 §8.1: the request is not needed
        with contextlib.suppress(_Closed):
            connection.write(out)


class H2Connection(asyncio.Protocol):
    """One client connection: frames in, calls started, responses out."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self._transport: asyncio.Transport | None = None
        self.peer = ""
        self._buffer = b""
        self._preface = False
        self._decoder = wire.HeaderDecoder()
        self._blocks = h2.HeaderBlocks()
        self.calls: dict[int, Call] = {}
        self._last_stream_id = 0
        self.send_window = h2.DEFAULT_WINDOW
        self.peer_initial_window = h2.DEFAULT_WINDOW
        self._max_frame = h2.DEFAULT_MAX_FRAME
        self._received = 0
        self._room = asyncio.Event()                 # set when windows grow or the transport drains
        self._paused = False
        self._going_away = False
        self._pending: list[bytes] = []              # written this pass of the loop, not yet sent
        # Looked up once: get_running_loop is a getpid() system call per call in CPython 3.11.
        self._loop = asyncio.get_running_loop()

    # --- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)   # uvloop's is not a subclass of it
        sock = self._transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = self._transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{'ipv6' if ':' in peer[0] else 'ipv4'}:{peer[0]}:{peer[1]}"
        self.server.connections.add(self)
        self._transport.write(h2.settings_frame({h2.SETTINGS_ENABLE_PUSH: 0,
                                                 h2.SETTINGS_MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                                                 h2.SETTINGS_INITIAL_WINDOW_SIZE: STREAM_WINDOW})
                              + h2.window_update(0, h2.MAX_WINDOW - h2.DEFAULT_WINDOW))
        if self.server.stopping:
            self.go_away()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._transport = None
        self._room.set()
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.peer_reset()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._room.set()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        if not self._preface:
            if len(buffer) < len(h2.PREFACE):
                self._buffer = buffer
                return
            if not buffer.startswith(h2.PREFACE):
                self._fail("not an HTTP/2 client preface")
                return
            self._preface = True
            buffer = buffer[len(h2.PREFACE):]
        frames, self._buffer = h2.split_frames(buffer)
        # We never raise SETTINGS_MAX_FRAME_SIZE from its default: a longer frame is a connection error
        # (RFC 9113 §4.2), refused once its 9-byte head says so, before its payload is buffered.
        if len(self._buffer) >= 9 and h2.frame_length(self._buffer) > h2.DEFAULT_MAX_FRAME or \
                any(len(frame.payload) > h2.DEFAULT_MAX_FRAME for frame in frames):
            self._fail(f"a frame over {h2.DEFAULT_MAX_FRAME} bytes", FRAME_SIZE_ERROR)
            return
        try:
            for frame in frames:
                self._on_frame(frame)
        except (hpack.HPACKError, ValueError, KeyError) as exc:
            self._fail(str(exc))

    # --- what calls use -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queue `data` for the socket; everything queued in one pass of the event loop goes out in one
        send at its end (the streams a tail batch wakes share a connection: one syscall, not one each)."""
        if self._transport is None:
            raise _Closed()
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and self._transport is not None:
            self._transport.write(b"".join(pending) if len(pending) > 1 else pending[0])

    def headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> bytes:
        """A header block in frames the client accepts (its SETTINGS_MAX_FRAME_SIZE)."""
        return h2.headers(stream_id, block, end_stream, self._max_frame)

    def writable(self, call: Call, size: int) -> bool:
        """Whether `size` bytes of DATA may go out on `call` now, in one frame."""
        return (not self._paused and size <= self.send_window and size <= call.send_window
                and size <= self._max_frame and self._transport is not None)

    async def send_data(self, call: Call, data: bytes) -> None:
        """DATA within the windows and frame size, waiting for room (a slow reader holds its writer)."""
        view = memoryview(data)
        while view:
            if self._transport is None or self.calls.get(call.stream_id) is not call:
                raise _Closed()
            room = min(self.send_window, call.send_window, self._max_frame, len(view))
            if room <= 0 or self._paused:
                self._room.clear()
                await self._room.wait()
                continue
            self.write(h2.frame(h2.DATA, 0, call.stream_id, bytes(view[:room])))
            self.send_window -= room
            call.send_window -= room
            view = view[room:]

    def call_done(self, call: Call) -> None:
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
        self.server.call_done()
        if self._going_away and not self.calls:
            self.close()

    def go_away(self) -> None:
        """GOAWAY: the streams opened so far finish, later ones are refused; closed once drained."""
        if self._going_away or self._transport is None:
            return
        self._going_away = True
        self.write(h2.frame(h2.GOAWAY, 0, 0, h2.goaway_payload(self._last_stream_id, NO_ERROR)))
        if not self.calls:
            self.close()

    def close(self) -> None:
        """Close once what is queued went out."""
        self.flush()
        if self._transport is not None:
            self._transport.close()

    # --- frames in --------------------------------------------------------------------------------

    def _on_frame(self, frame: h2.Frame) -> None:
        kind = frame.type
        if self._blocks.takes(frame):
            block = self._blocks.add(frame)
            if block is not None:
                self._on_headers(block)
        elif kind == h2.DATA:
            self._on_data(frame)
        elif kind == h2.RST_STREAM:
            call = self.calls.pop(frame.stream_id, None)
            if call is not None:
                call.peer_reset()
        elif kind == h2.SETTINGS:
            if not frame.flags & h2.ACK:
                self._on_settings(h2.parse_settings(frame.payload))
        elif kind == h2.PING:
            if not frame.flags & h2.ACK:
                self.write(h2.frame(h2.PING, h2.ACK, 0, frame.payload))
        elif kind == h2.WINDOW_UPDATE:
            increment = h2.parse_u32(frame.payload)
            if frame.stream_id == 0:
                self.send_window += increment
            elif (call := self.calls.get(frame.stream_id)) is not None:
                call.send_window += increment
            self._room.set()
        elif kind == h2.GOAWAY:
            pass                     # the client opens no more streams; those in progress go on
        elif kind == h2.PUSH_PROMISE:
            raise ValueError("PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored (RFC 9113 §4.1, §5.5).

    def _on_data(self, frame: h2.Frame) -> None:
        size = len(frame.payload)
        self._received, update = h2.refill(self._received, size, 0)
        if update:
            self.write(update)
        call = self.calls.get(frame.stream_id)
        if call is None:
            return                   # ended here: its late frames only count for the window
        if call.unacked + size > STREAM_WINDOW:
            # Past the window this side gave (every update gives back exactly what was unacked): a
            # client ignoring flow control would queue without bound; the stream is reset (RFC 9113 §6.9.1).
            del self.calls[call.stream_id]
            call.peer_reset()
            self.write(h2.rst_stream(call.stream_id, FLOW_CONTROL_ERROR))
            return
        try:
            messages = call.reader.feed(h2.unpadded(frame) if frame.flags & h2.PADDED else frame.payload,
                                        MAX_RECEIVE_BYTES, call.inflate)
        except h2.MessageTooLarge as exc:
            call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, ERR_TOO_LARGE.format(size=exc.size,
                                                                                 limit=MAX_RECEIVE_BYTES))
            self._drop(call)
            return
        except (ValueError, zlib.error) as exc:
            call.finish(grpc.StatusCode.INTERNAL,
                        ERR_INFLATE.format(error=exc) if call.inflate else ERR_UNDECLARED)
            self._drop(call)
            return
        for body in messages:
            call.request_message(body)
        if update := call.received(size):
            self.write(update)
        if frame.flags & h2.END_STREAM:
            call.peer_ended()
            if call.task is None:
                self._drop(call)

    def _drop(self, call: Call) -> None:
        """A call answered before its handler started: forgotten, its late frames ignored."""
        if self.calls.get(call.stream_id) is call and call.task is None:
            del self.calls[call.stream_id]

    def _on_headers(self, block: h2.HeaderBlock) -> None:
        headers = self._decoder.decode(block.data)
        stream_id = block.stream_id
        if stream_id in self.calls:
            if block.end_stream:     # trailers from the client: its side is done
                self.calls[stream_id].peer_ended()
            return
        if stream_id % 2 == 0 or stream_id <= self._last_stream_id:
            raise ValueError(f"HEADERS on stream {stream_id}, not a new client stream")
        if self._going_away or len(self.calls) >= MAX_CONCURRENT_STREAMS:
            self._last_stream_id = max(self._last_stream_id, stream_id)
            self.write(h2.rst_stream(stream_id, REFUSED_STREAM))
            return
        self._last_stream_id = stream_id
        head = wire.call_head(headers)
        handler = self.server.handler(head)
        if handler is None:
            self._answer_at_once(stream_id, block.end_stream, grpc.StatusCode.UNIMPLEMENTED,
                                 ERR_UNIMPLEMENTED)
            return
        if head.encoding != "identity" and wire.decompressor(head.encoding, 0) is None:
            self._answer_at_once(stream_id, block.end_stream, grpc.StatusCode.UNIMPLEMENTED,
                                 ERR_ENCODING.format(encoding=head.encoding))
            return
        call = Call(self, stream_id, head, handler)
        self.calls[stream_id] = call
        if handler.request_streaming:
            call.start()
        if block.end_stream:
            call.peer_ended()
            if call.task is None:
                self._drop(call)

    def _answer_at_once(self, stream_id: int, end_stream: bool, code: grpc.StatusCode, details: str) -> None:
        block = wire.RESPONSE_HEADERS + wire.status_block(code, details)
        out = self.headers(stream_id, block, end_stream=True)
        self.write(out if end_stream else out + h2.rst_stream(stream_id, NO_ERROR))

    def _on_settings(self, settings: dict[int, int]) -> None:
        initial = settings.get(h2.SETTINGS_INITIAL_WINDOW_SIZE)
        if initial is not None:
            for call in self.calls.values():
                call.send_window += initial - self.peer_initial_window
            self.peer_initial_window = initial
        self._max_frame = settings.get(h2.SETTINGS_MAX_FRAME_SIZE, self._max_frame)
        self.write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        self._room.set()

    def _fail(self, why: str, code: int = PROTOCOL_ERROR) -> None:
        log.info("closing an HTTP/2 connection from %s: %s", self.peer or "?", why)
        if self._transport is not None:
            self._pending = []
            self._buffer = b""
            self._transport.write(h2.frame(h2.GOAWAY, 0, 0, h2.goaway_payload(self._last_stream_id, code)))
            self._transport.abort()


class H2Server:
    """The parts of grpc.aio.Server that services/main.py and the services' registration use."""

    def __init__(self, reuse_port: bool = False) -> None:
        self.reuse_port = reuse_port
        self.connections: set[H2Connection] = set()
        self.stopping = False
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # --- registration (as grpc.aio.Server) --------------------------------------------------------

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for method, handler in method_handlers.items():
            self._registered[f"/{service_name}/{method}"] = handler

    def handler(self, head: wire.CallHead) -> grpc.RpcMethodHandler | None:
        found = self._registered.get(head.path)
        if found is not None:
            return found
        details = _CallDetails(head.path, head.metadata)
        for generic in self._generic:
            found = generic.service(details)
            if found is not None:
                return found
        return None

    def add_insecure_port(self, address: str) -> int:
        """Bind `address` ("host:port", port 0 for any) now, as grpc does; the bound port. Raises
        RuntimeError when the port is taken (SO_REUSEPORT only with reuse_port) or unresolvable."""
        host, _, port_text = address.rpartition(":")
        port = int(port_text)
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise RuntimeError(f"cannot resolve {address}: {exc}") from exc
        bound: list[socket.socket] = []
        try:
            for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                bound.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self.reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(sockaddr[:1] + (port,) + sockaddr[2:])
                port = sock.getsockname()[1]       # port 0: every family on the port the first got
                sock.listen(1024)
                sock.setblocking(False)
        except OSError as exc:
            for sock in bound:
                sock.close()
            raise RuntimeError(f"cannot listen on {address}: {exc}") from exc
        self._sockets.extend(bound)
        return port

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        raise NotImplementedError("TLS is served by grpc.aio ([gateway].grpc_server is ignored with [tls])")

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            self._servers.append(await loop.create_server(lambda: H2Connection(self), sock=sock))

    async def stop(self, grace: float | None) -> None:
        """Stop listening, GOAWAY every connection; calls in progress get `grace` seconds, then are
        cancelled (UNAVAILABLE); every connection is closed."""
        self.stopping = True
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.go_away()
        if grace:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for connection in list(self.connections):
            for call in list(connection.calls.values()):
                if call.task is not None:
                    call.task.cancel()
        await asyncio.sleep(0)
        for connection in list(self.connections):
            connection.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    def call_started(self) -> None:
        self._active += 1
        self._idle.clear()

    def call_done(self) -> None:
        self._active -= 1
        if self._active <= 0:
            self._active = 0
            self._idle.set()

