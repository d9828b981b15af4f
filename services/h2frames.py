"""HTTP/2 frames and gRPC message framing, pure (RFC 9113 §4, §6; gRPC's PROTOCOL-HTTP2): no I/O.

Just what a gRPC client of one streaming RPC needs (services/replica_conn.py): cut a byte stream
into frames, cut a stream's DATA into length-prefixed gRPC messages, and build the frames a
client sends. Header blocks are left to hpack; flow-control accounting and stream state are the
connection's.

    frame:        | length (24) | type (8) | flags (8) | R + stream id (31) | payload ... |
    gRPC message: | compressed (8) | length (32) | protobuf bytes ... |   (may span DATA frames)
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

(DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE,
 CONTINUATION) = range(10)

END_STREAM = 0x1      # DATA, HEADERS
ACK = 0x1             # SETTINGS, PING
END_HEADERS = 0x4     # HEADERS, CONTINUATION
PADDED = 0x8          # DATA, HEADERS
PRIORITY_FLAG = 0x20  # HEADERS

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5

CANCEL = 0x8          # RST_STREAM error code: the client no longer wants the stream
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
DEFAULT_HEADER_TABLE = 4_096      # HPACK's dynamic table, until SETTINGS_HEADER_TABLE_SIZE says otherwise
# A header block (HEADERS and its CONTINUATIONs) longer than this is refused: without a bound, a
# peer that never sends END_HEADERS grows it without end (the CONTINUATION flood).
MAX_HEADER_BLOCK = 64 * 1024

_HEAD = struct.Struct(">BHBBL")      # length split 8 + 16 bits, type, flags, stream id
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")
_GRPC_PREFIX = struct.Struct(">BL")


@dataclass(frozen=True, slots=True)
class Frame:
    type: int
    flags: int
    stream_id: int
    payload: bytes


# A frame head at an offset of a buffer: (length's high 8 bits, its low 16, type, flags, R + stream id).
# For a reader that handles frames as it cuts them (replica_conn) instead of building a Frame each.
unpack_head = _HEAD.unpack_from


def split_frames(buffer: bytes) -> tuple[list[Frame], bytes]:
    """The complete frames at the start of `buffer`, and the incomplete rest (kept for the next read)."""
    frames = []
    pos, size = 0, len(buffer)
    unpack = _HEAD.unpack_from
    while size - pos >= 9:
        high, low, kind, flags, stream_id = unpack(buffer, pos)
        end = pos + 9 + (high << 16 | low)
        if end > size:
            break
        frames.append(Frame(kind, flags, stream_id & 0x7FFFFFFF, buffer[pos + 9:end]))
        pos = end
    return frames, buffer[pos:]


def frame_length(buffer: bytes) -> int:
    """The payload length a frame's 9-byte head at the start of `buffer` announces."""
    high, low, _, _, _ = _HEAD.unpack_from(buffer, 0)
    return int(high << 16 | low)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return _HEAD.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


def headers(stream_id: int, block: bytes, end_stream: bool = False,
            max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """A header block as HEADERS, followed by CONTINUATIONs when it is longer than one frame may be."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    pieces = [block[at:at + max_frame] for at in range(0, len(block), max_frame)]
    return (frame(HEADERS, flags, stream_id, pieces[0])
            + b"".join(frame(CONTINUATION, 0, stream_id, piece) for piece in pieces[1:-1])
            + frame(CONTINUATION, END_HEADERS, stream_id, pieces[-1]))


def unpadded(frame_: Frame) -> bytes:
    """A DATA or HEADERS frame's payload without its padding (and a HEADERS frame's priority fields)."""
    payload = frame_.payload
    start, end = 0, len(payload)
    if frame_.flags & PADDED:
        start, end = 1, end - payload[0]
    if frame_.type == HEADERS and frame_.flags & PRIORITY_FLAG:
        start += 5
    return payload[start:end]


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(key, value) for key, value in settings.items()))


def parse_settings(payload: bytes) -> dict[int, int]:
    return dict(_SETTING.iter_unpack(payload[:len(payload) - len(payload) % 6]))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def parse_u32(payload: bytes) -> int:
    """A WINDOW_UPDATE's increment, a RST_STREAM's error code."""
    return int(_U32.unpack_from(payload)[0]) & 0x7FFFFFFF


def parse_goaway(payload: bytes) -> tuple[int, int]:
    """(last stream id the server processes, error code)."""
    last, code = _GOAWAY.unpack_from(payload)
    return last & 0x7FFFFFFF, code


def goaway_payload(last_stream_id: int, code: int) -> bytes:
    return _GOAWAY.pack(last_stream_id, code)


WINDOW_REFILL = 1 << 30      # bytes received on a window opened wide before it is topped up again


def refill(received: int, size: int, stream_id: int) -> tuple[int, bytes]:
    """`size` more bytes received on a window opened wide (stream 0: the connection's): the new count,
    and the WINDOW_UPDATE to send now (b"" until WINDOW_REFILL bytes have come)."""
    received += size
    if received >= WINDOW_REFILL:
        return 0, window_update(stream_id, received)
    return received, b""


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def grpc_message(body: bytes) -> bytes:
    """One uncompressed gRPC message as it travels in DATA frames."""
    return _GRPC_PREFIX.pack(0, len(body)) + body


@dataclass(frozen=True, slots=True)
class HeaderBlock:
    """A whole header block: a HEADERS frame's fragment and its CONTINUATIONs', joined."""

    stream_id: int
    end_stream: bool          # the HEADERS frame ended the stream (trailers, or a request without body)
    data: bytes               # for hpack to decode


class HeaderBlocks:
    """Gathers header blocks (RFC 9113 §6.2, §6.10): a HEADERS frame, then CONTINUATIONs of the same
    stream until END_HEADERS, and no other frame in between."""

    __slots__ = ("_stream_id", "_end_stream", "_parts", "_size", "_limit")

    def __init__(self, limit: int = MAX_HEADER_BLOCK) -> None:
        self._stream_id = 0
        self._end_stream = False
        self._parts: list[bytes] | None = None      # None: no block under way
        self._size = 0
        self._limit = limit

    @property
    def open(self) -> bool:
        """A block is under way: the next frame must be its CONTINUATION."""
        return self._parts is not None

    def takes(self, frame: Frame) -> bool:
        """Whether `frame` is part of a header block; raises ValueError for any other frame arriving
        inside one."""
        if frame.type in (HEADERS, CONTINUATION):
            return True
        if self._parts is not None:
            raise ValueError("a header block interrupted by another frame")
        return False

    def add(self, frame: Frame) -> HeaderBlock | None:
        """Take a HEADERS or CONTINUATION frame; the block once END_HEADERS completes it."""
        if frame.type == HEADERS:
            if self._parts is not None:
                raise ValueError("a header block interrupted by another frame")
            first = unpadded(frame)
            self._stream_id, self._end_stream, self._parts = (frame.stream_id, bool(frame.flags & END_STREAM),
                                                              [first])
            self._size = len(first)
        elif self._parts is None or frame.stream_id != self._stream_id:
            raise ValueError("CONTINUATION outside a header block")
        else:
            self._parts.append(frame.payload)
            self._size += len(frame.payload)
        if self._size > self._limit:
            raise ValueError(f"a header block over {self._limit} bytes")
        if not frame.flags & END_HEADERS:
            return None
        parts, self._parts = self._parts, None
        return HeaderBlock(self._stream_id, self._end_stream, b"".join(parts))


class MessageTooLarge(ValueError):
    """A gRPC message longer than the reader accepts (its length prefix says so, before it arrives)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"gRPC message of {size} bytes")
        self.size = size


class MessageReader:
    """Cuts one stream's DATA into gRPC messages. A message may span frames and a frame may hold
    several; the common case (a frame holding exactly one whole message) copies nothing."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes, limit: int | None = None,
             decompress: Callable[[bytes], bytes] | None = None) -> list[bytes]:
        """The messages `data` completes, in order, a compressed one through `decompress`. Raises
        ValueError on a compressed message without `decompress` (this side asked for none),
        MessageTooLarge on one longer than `limit` (`decompress` holds its output to the same)."""
        if not self._pending and len(data) >= 5 and decompress is None:
            # The usual frame: exactly one whole uncompressed message (one response per token).
            compressed, length = _GRPC_PREFIX.unpack_from(data)
            if not compressed and length == len(data) - 5 and (limit is None or length <= limit):
                return [data[5:]]
        buffer = self._pending + data if self._pending else data
        messages = []
        pos, size = 0, len(buffer)
        while size - pos >= 5:
            compressed, length = _GRPC_PREFIX.unpack_from(buffer, pos)
            if compressed and decompress is None:
                raise ValueError("compressed gRPC message on a stream that asked for none")
            if limit is not None and length > limit:
                raise MessageTooLarge(length)
            end = pos + 5 + length
            if end > size:
                break
            body = buffer[pos + 5:end]
            messages.append(decompress(body) if compressed and decompress else body)
            pos = end
        self._pending = buffer[pos:]
        return messages

    def pending(self) -> bool:
        return bool(self._pending)
