"""gRPC over HTTP/2 as a server writes and reads it, pure (gRPC's PROTOCOL-HTTP2.md): no I/O.

What services/h2server.py needs beyond the frames (h2frames.py): the request's header block turned
into the call's path, deadline and metadata; the response's header blocks (initial headers, the
status trailers, a trailers-only answer). Every block this side sends is written as HPACK literals
that never enter the dynamic table (RFC 7541 §6.2.2), so the server needs no encoder state to keep
in step with the client's decoder and the common blocks are constant bytes.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import grpc
import hpack
from sluice.services.h2frames import MessageTooLarge

# Header names a client sends that are the protocol's, not the caller's metadata.
_RESERVED = frozenset((b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                       b"grpc-message-type", b"host"))
_TIMEOUT_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}

ERR_NOT_GRPC = "content-type {value!r} is not application/grpc"
ERR_NO_PATH = "no :path in the request's headers"
ERR_METHOD = "HTTP method {value!r}: gRPC requests are POST"


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) whose first byte carries `first`'s high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7, 0) + data          # no Huffman coding


def literal(name: bytes, value: bytes) -> bytes:
    """One header as a literal field without indexing, new name (RFC 7541 §6.2.2)."""
    return b"\x00" + _string(name) + _string(value)


# :status 200 is entry 8 of the static table (an indexed field changes no table either).
RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")
OK_TRAILERS = literal(b"grpc-status", b"0")


def percent_encoded(text: str) -> bytes:
    """grpc-message's encoding: UTF-8, with every byte outside printable ASCII (and '%') as %XX."""
    out = bytearray()
    for byte in text.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def metadata_block(metadata: Iterable[tuple[str, str | bytes]]) -> bytes:
    """Custom metadata as header fields: keys lower-case, `-bin` values base64 (unpadded)."""
    out = bytearray()
    for key, value in metadata:
        name = key.lower().encode("ascii")
        if name.endswith(b"-bin"):
            raw = value if isinstance(value, bytes) else value.encode("utf-8")
            out += literal(name, base64.b64encode(raw).rstrip(b"="))
        else:
            out += literal(name, value if isinstance(value, bytes) else value.encode("ascii"))
    return bytes(out)


def status_block(code: grpc.StatusCode, details: str | None,
                 metadata: Sequence[tuple[str, str | bytes]] = ()) -> bytes:
    """The trailers that end a call: grpc-status, grpc-message when there is one, the metadata."""
    if code is grpc.StatusCode.OK and not details and not metadata:
        return OK_TRAILERS
    block = literal(b"grpc-status", str(code.value[0]).encode("ascii"))
    if details:
        block += literal(b"grpc-message", percent_encoded(details))
    return block + metadata_block(metadata)


def timeout_s(value: bytes) -> float | None:
    """grpc-timeout ("100m", "5S", at most 8 digits and a unit) in seconds; None if malformed."""
    unit = _TIMEOUT_UNIT_S.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


@dataclass(frozen=True, slots=True)
class CallHead:
    """What a request's header block says about the call."""

    path: str                                      # "/sluice.v1.Admission/Submit"
    timeout_s: float | None                        # grpc-timeout; None: no deadline
    metadata: tuple[tuple[str, str | bytes], ...]  # the caller's metadata, as grpc.aio hands it over
    encoding: str                                  # grpc-encoding: how compressed messages are ("identity")


def call_head(headers: Sequence[tuple[bytes, bytes]]) -> CallHead:
    """The call a request's decoded header block opens; raises ValueError when it is not a gRPC call."""
    path = b""
    timeout = None
    encoding = "identity"
    metadata: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name.startswith(b":"):
            if name == b":path":
                path = value
            elif name == b":method" and value != b"POST":
                raise ValueError(ERR_METHOD.format(value=value.decode(errors="replace")))
            continue
        if name in _RESERVED:
            if name == b"content-type" and not value.startswith(b"application/grpc"):
                raise ValueError(ERR_NOT_GRPC.format(value=value.decode(errors="replace")))
            elif name == b"grpc-timeout":
                timeout = timeout_s(value)
            elif name == b"grpc-encoding":
                encoding = value.decode("ascii", "replace")
            continue
        key = name.decode("ascii", "replace")
        if name.endswith(b"-bin"):
            metadata.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            metadata.append((key, value.decode("ascii", "replace")))
    if not path:
        raise ValueError(ERR_NO_PATH)
    return CallHead(path.decode("ascii", "replace"), timeout, tuple(metadata), encoding)


# A connection's repeated request blocks are remembered up to these bounds (a gRPC client's are tens of
# bytes once its fields are in the dynamic table; a client sending ever new blocks only empties it).
MAX_REMEMBERED_BLOCKS = 64
MAX_REMEMBERED_BLOCK_BYTES = 512


class HeaderDecoder:
    """One connection's HPACK decoder (RFC 7541), which decodes a block it has seen once.

    A gRPC client's requests on a connection repeat the same header block byte for byte: after its
    first call every field is a reference into the dynamic table (only a deadline may vary, and it is
    sent as a literal that does not enter the table). Decoding is a function of the block and of the
    dynamic table alone, so a block whose decoding left the table as it was decodes to the same
    headers again for as long as the table stays as it is: it is remembered until any block changes
    the table (an insertion, an eviction, a size update), which forgets every block remembered.
    Python's hpack spends ~25 us on such a block; a remembered one costs a dict lookup.
    """

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._known: dict[bytes, tuple[tuple[bytes, bytes], ...]] = {}

    def decode(self, block: bytes) -> tuple[tuple[bytes, bytes], ...]:
        """The block's headers as (name, value) bytes; raises hpack.HPACKError on a bad block."""
        known = self._known.get(block)
        if known is not None:
            return known
        table = self._decoder.header_table
        entries = table.dynamic_entries
        size, newest, limit = len(entries), entries[0] if entries else None, table.maxsize
        headers = tuple(cast(Sequence[tuple[bytes, bytes]], self._decoder.decode(block, raw=True)))
        # Every insertion puts a new tuple at the front, every eviction shortens the deque.
        if len(entries) != size or (entries[0] if entries else None) is not newest or table.maxsize != limit:
            self._known.clear()
        elif len(block) <= MAX_REMEMBERED_BLOCK_BYTES:
            if len(self._known) >= MAX_REMEMBERED_BLOCKS:
                self._known.clear()
            self._known[block] = headers
        return headers


# zlib's window bits for each grpc-encoding a request may use (responses go out uncompressed, which
# every gRPC client accepts).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ACCEPTED_ENCODINGS = "identity," + ",".join(_WBITS)


def decompressor(encoding: str, limit: int) -> Callable[[bytes], bytes] | None:
    """How a request's compressed messages are inflated (at most `limit` bytes each, else
    MessageTooLarge); None for an encoding this server does not take (identity needs none)."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        return None

    def inflate(data: bytes) -> bytes:
        inflater = zlib.decompressobj(wbits)
        out = inflater.decompress(data, limit + 1)
        if len(out) > limit:
            raise MessageTooLarge(len(out))
        return out

    return inflate
