"""The two Kafka requests the gateway's reads need, encoded and decoded by hand (pure, no I/O).

aiokafka's consumer builds every fetch through its generic protocol structs (a Python object per
field, per partition, per request) and hands each record over as a ConsumerRecord; on the gateway
that machinery cost more than the records it carried (~1 ms of CPU per fetch). The lean read path
(eventlog/fetcher.py) sends these instead, over aiokafka's own connections:

    Fetch v4        one topic, the followed partitions at their positions
                    -> per partition: error code, high watermark, record batches (raw bytes)
    ListOffsets v1  one topic, partitions at a timestamp (-1 latest, -2 earliest)
                    -> per partition: error code, offset

Fetch v4 is the oldest version Kafka 4 still answers and the newest without fetch sessions; a
consumer's fetch (replica_id -1) never gets records at or past the high watermark, so everything
decoded here is durable. Record batches are read by aiokafka's C reader, one record at a time,
straight into (offset, key, value).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from aiokafka.errors import CorruptRecordException
from aiokafka.record.memory_records import MemoryRecords

FETCH_API, FETCH_VERSION = 1, 4
LIST_OFFSETS_API, LIST_OFFSETS_VERSION = 2, 1
LATEST, EARLIEST = -1, -2            # ListOffsets timestamps
CONSUMER = -1                        # replica_id of a consumer: the broker caps it at the high watermark
READ_UNCOMMITTED = 0

# Partition error codes the read path reacts to (everything else is unexpected).
NONE = 0
OFFSET_OUT_OF_RANGE = 1
LEADER_NOT_AVAILABLE = 5
# The partition's leadership moved or is moving: refresh metadata, ask the new leader.
RETRIABLE = frozenset({
    3,    # UNKNOWN_TOPIC_OR_PARTITION (metadata not yet on this broker)
    5,    # LEADER_NOT_AVAILABLE
    6,    # NOT_LEADER_OR_FOLLOWER
    7,    # REQUEST_TIMED_OUT
    9,    # REPLICA_NOT_AVAILABLE
    13,   # NETWORK_EXCEPTION
    56,   # KAFKA_STORAGE_ERROR
    74,   # FENCED_LEADER_EPOCH
    75,   # UNKNOWN_LEADER_EPOCH
    78,   # OFFSET_NOT_AVAILABLE
})

_HEADER = struct.Struct(">hhih")             # api key, version, correlation id, client id length
_FETCH_TOP = struct.Struct(">iiiibi")        # replica, max wait, min bytes, max bytes, isolation, topics
_FETCH_PARTITION = struct.Struct(">iqi")     # partition, offset, partition max bytes
_LIST_TOP = struct.Struct(">ii")             # replica, topics
_LIST_PARTITION = struct.Struct(">iq")       # partition, timestamp
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_FETCHED = struct.Struct(">ihqq")            # partition, error, high watermark, last stable offset
_LISTED = struct.Struct(">ihqq")             # partition, error, timestamp, offset
_ABORTED = 16                                # bytes per aborted transaction (producer id, first offset)


@dataclass(frozen=True, slots=True)
class FetchedPartition:
    partition: int
    error: int
    high_watermark: int
    records: bytes          # zero or more record batches, the last one possibly cut short


def _string(value: str) -> bytes:
    raw = value.encode()
    return _I16.pack(len(raw)) + raw


def request_header(api: int, version: int, correlation_id: int, client_id: str) -> bytes:
    raw = client_id.encode()
    return _HEADER.pack(api, version, correlation_id, len(raw)) + raw


def fetch_body(topic: str, positions: list[tuple[int, int]], *, max_wait_ms: int, min_bytes: int,
               max_bytes: int, partition_max_bytes: int) -> bytes:
    """A Fetch v4 request body for `topic` at `positions` [(partition, offset)]."""
    parts = [_FETCH_TOP.pack(CONSUMER, max_wait_ms, min_bytes, max_bytes, READ_UNCOMMITTED, 1),
             _string(topic), _I32.pack(len(positions))]
    parts += [_FETCH_PARTITION.pack(partition, offset, partition_max_bytes)
              for partition, offset in positions]
    return b"".join(parts)


def list_offsets_body(topic: str, partitions: list[int], timestamp: int) -> bytes:
    parts = [_LIST_TOP.pack(CONSUMER, 1), _string(topic), _I32.pack(len(partitions))]
    parts += [_LIST_PARTITION.pack(partition, timestamp) for partition in partitions]
    return b"".join(parts)


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at

    def unpack(self, layout: struct.Struct) -> tuple[int, ...]:
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def int32(self) -> int:
        return int(self.unpack(_I32)[0])

    def skip_string(self) -> None:
        self.at += _I16.size + max(0, int(self.unpack(_I16)[0]))


def decode_fetch(data: bytes, at: int = 0) -> list[FetchedPartition]:
    """A Fetch v4 response body (from `at`, past the response header): every partition of every topic."""
    reader = _Reader(data, at)
    reader.at += 4                                  # throttle_time_ms
    fetched: list[FetchedPartition] = []
    for _ in range(reader.int32()):
        reader.skip_string()                        # one topic per request: ours
        for _ in range(reader.int32()):
            partition, error, high_watermark, _stable = reader.unpack(_FETCHED)
            aborted = reader.int32()
            reader.at += max(0, aborted) * _ABORTED
            size = reader.int32()
            records = b"" if size <= 0 else data[reader.at:reader.at + size]
            reader.at += max(0, size)
            fetched.append(FetchedPartition(partition, error, high_watermark, records))
    return fetched


def decode_list_offsets(data: bytes, at: int = 0) -> dict[int, tuple[int, int]]:
    """A ListOffsets v1 response body: partition -> (error code, offset)."""
    reader = _Reader(data, at)
    listed: dict[int, tuple[int, int]] = {}
    for _ in range(reader.int32()):
        reader.skip_string()
        for _ in range(reader.int32()):
            partition, error, _timestamp, offset = reader.unpack(_LISTED)
            listed[partition] = (error, offset)
    return listed


def decode_records(records: bytes, position: int) -> tuple[list[tuple[int, bytes | None, bytes | None]], int]:
    """The data records of `records` (fetched at `position`) at offsets >= position as (offset, key,
    value) in offset order, and where the next fetch starts: past the last complete batch. A batch
    that starts before `position` (the broker answers from the batch holding it) gives only its
    later records; a batch cut short at the end of the response is left for the next fetch; control
    batches (transaction markers) carry no data but are passed."""
    batches = MemoryRecords(records)
    found: list[tuple[int, bytes | None, bytes | None]] = []
    while (batch := batches.next_batch()) is not None:
        if not batch.validate_crc():
            raise CorruptRecordException(f"record batch at offset {batch.base_offset}: invalid CRC")
        following = batch.next_offset
        if following <= position:
            continue
        if not batch.is_control_batch:
            found += [(record.offset, record.key, record.value) for record in batch
                      if record.offset >= position]
        position = following
    return found, position
