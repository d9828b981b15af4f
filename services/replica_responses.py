"""A replica stream's responses read from their bytes by the layout of the previous one, pure.

A streamed ModelStreamInferResponse is ~170 bytes, and every response of one stream but its final one
is the same message except for the output values: same model and request id, the same
triton_final_response=false parameter, the same output names, types and shapes, then the raw output
contents, one length-prefixed field each, last:

    | ... all but the values: the stream's prefix ... | 32 04 <output_ids> | 32 04 <seq len> | 32 04 <reused>
      └───── identical from one response to the next ─┘ └── same tags and lengths, new values ───────────┘

Parsing each one with protobuf and reading its tensors through the message's accessors cost ~9 us per
token on a warm cache and three times that on the routing worker's cold one (the largest share of its
replica read path). Once a response has been parsed in full, `ResponseLayout.learn` keeps its prefix
and where each value sits; a later response of the same length, with the same prefix byte for byte and
the same tags and lengths around its values, parses to the same message but for those values, which
are then read at their offsets (`tokens`). Anything else (the final response, an error, a response
with more tokens) takes the full parse, which learns its layout in turn.

The layout is learned only when it is proven: the same prefix followed by different value bytes must
parse to the same message with exactly those values (`learn` checks it with protobuf), so the offsets
cannot belong to another field.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

MAX_LAYOUTS = 8                # per stream, one per message length (responses of 1, 2, ... tokens)
RAW_TAG = 0x32                 # ModelInferResponse field 6 (raw_output_contents), length-delimited
MAX_SHORT_LENGTH = 0x7F        # a length that fits in one varint byte (the layout assumes it)
_INT_CODES = {"INT32": ("i", 4), "INT64": ("q", 8)}


@dataclass(frozen=True, slots=True)
class _Layout:
    prefix: bytes                              # everything before the first value's tag
    headers: tuple[bytes, ...]                 # each value's tag and length byte, in order
    read_headers: Callable[[bytes, int], tuple[Any, ...]]      # unpacks them from the prefix's end
    ids_at: int                                # output_ids' offset in the message
    read_ids: Callable[[bytes, int], tuple[Any, ...]]
    reused_at: int                             # kv_cache_reused_blocks' offset; -1: not sent
    read_reused: Callable[[bytes, int], tuple[Any, ...]] | None


class ResponseLayout:
    """One stream's learned layouts, by message length (a replica that sends several tokens per
    response has one per count). `tokens` is the fast read; `learn` follows a full parse."""

    __slots__ = ("_layouts",)

    def __init__(self) -> None:
        self._layouts: dict[int, _Layout] = {}

    def tokens(self, body: bytes) -> tuple[tuple[int, ...], int | None] | None:
        """(output ids, reused blocks or None when not sent) when `body` has a learned layout; None
        when it must be parsed in full."""
        layout = self._layouts.get(len(body))
        if layout is None or not body.startswith(layout.prefix):
            return None
        if layout.read_headers(body, len(layout.prefix)) != layout.headers:
            return None
        ids = layout.read_ids(body, layout.ids_at)
        if layout.read_reused is None:
            return ids, None
        return ids, layout.read_reused(body, layout.reused_at)[0]

    def learn(self, body: bytes, message: service_pb2.ModelStreamInferResponse) -> None:
        """After a full parse of `body` into `message`: keep its layout when it is a non-final response
        whose raw outputs end it, proven by a probe (module doc)."""
        if len(self._layouts) < MAX_LAYOUTS and len(body) not in self._layouts:
            layout = layout_of(body, message)
            if layout is not None:
                self._layouts[len(body)] = layout


def layout_of(body: bytes, message: service_pb2.ModelStreamInferResponse) -> _Layout | None:
    response = message.infer_response
    if message.error_message or not response.outputs or is_final(response):
        return None
    raws: Sequence[bytes] = list(response.raw_output_contents)
    names = [(output.name, output.datatype) for output in response.outputs]
    if len(raws) != len(names) or any(len(raw) > MAX_SHORT_LENGTH for raw in raws):
        return None
    ids = [index for index, (name, _) in enumerate(names) if name == "output_ids"]
    reused = [index for index, (name, _) in enumerate(names) if name == "kv_cache_reused_blocks"]
    if len(ids) != 1 or len(reused) > 1:
        return None
    headers = tuple(bytes((RAW_TAG, len(raw))) for raw in raws)
    tail = b"".join(header + raw for header, raw in zip(headers, raws, strict=True))
    if not body.endswith(tail):
        return None
    prefix = body[:len(body) - len(tail)]
    if not _proven(prefix, headers, raws, message):
        return None
    offsets, at = [], len(prefix)
    for raw in raws:
        offsets.append(at + 2)
        at += 2 + len(raw)
    read_ids = _reader(names[ids[0]][1], len(raws[ids[0]]))
    read_reused = _reader(names[reused[0]][1], len(raws[reused[0]])) if reused else None
    if read_ids is None or (reused and (read_reused is None or len(raws[reused[0]]) not in (4, 8))):
        return None
    header_format = "<" + "".join(f"2s{len(raw)}x" for raw in raws)
    return _Layout(prefix, headers, struct.Struct(header_format).unpack_from, offsets[ids[0]],
                   read_ids, offsets[reused[0]] if reused else -1, read_reused)


def _reader(datatype: str, size: int) -> Callable[[bytes, int], tuple[Any, ...]] | None:
    """Unpacks a little-endian integer tensor of `size` bytes (Triton's raw layout), or None when the
    type is not one the platform reads."""
    code = _INT_CODES.get(datatype)
    if code is None or size % code[1]:
        return None
    return struct.Struct(f"<{size // code[1]}{code[0]}").unpack_from


def _proven(prefix: bytes, headers: tuple[bytes, ...], raws: Sequence[bytes],
            message: service_pb2.ModelStreamInferResponse) -> bool:
    """The prefix followed by every value's bytes inverted parses to `message` with exactly those
    values: the offsets are the raw outputs' and nothing else's."""
    probes = [bytes(byte ^ 0xFF for byte in raw) for raw in raws]
    try:
        probed = service_pb2.ModelStreamInferResponse.FromString(
            prefix + b"".join(header + probe for header, probe in zip(headers, probes, strict=True)))
    except DecodeError:
        return False
    if list(probed.infer_response.raw_output_contents) != probes:
        return False
    del probed.infer_response.raw_output_contents[:]
    expected = service_pb2.ModelStreamInferResponse()
    expected.CopyFrom(message)
    del expected.infer_response.raw_output_contents[:]
    return probed == expected


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    """The response carries triton_final_response=true: the stream's last."""
    param = response.parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)
