"""Which partition of the events topic a run's events land on, and run ids chosen to land on one.

A run's events are keyed by its run id (DESIGN.md "Event log and resume": one run's events stay
ordered), and the producer puts a key where Kafka's default partitioner does:
murmur2(key) & 0x7fffffff modulo the topic's partition count. Nothing else decides it, so any
process that knows the run id and the partition count knows the partition.

The gateway that admits a run chooses its id (a random UUID), and so may choose one whose key
lands on a partition it follows: its *home* partitions. A stream opened on that gateway (a
client's Stream after its Submit, on the same connection) then reads a partition the gateway's
tail already follows, and each gateway's tail reads its own runs' events, not every gateway's
(issue 9: two gateways each read every event, ~15-30 us per token for the second). The choice
only draws random UUIDs until one lands home: the id is still a random UUID (a draw among them,
one bit of entropy less with two home partitions of four), the key is still the run id, and a
stream on any gateway still finds the run on the partition its key names.

murmur2 here is Kafka's (the Java client's Utils.murmur2, as aiokafka's partitioner has it), written
over 32-bit words unpacked at once: ~4 us for a run id against ~25 us for aiokafka's byte-by-byte
version (tests/test_eventlog_partitioning.py checks the two agree).
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Collection

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
# A run id's home draw gives up after this many: with one home partition of 64 the chance of
# missing is (63/64)**256 < 2e-2; the run then lands wherever its id says (correct, only not home).
MAX_DRAWS = 256


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of `data` (unsigned 32-bit)."""
    length = len(data)
    words = length // 4
    h = _SEED ^ length
    for k in struct.unpack_from(f"<{words}I", data):
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length & 3
    if tail:
        at = words * 4
        if tail >= 3:
            h ^= data[at + 2] << 16
        if tail >= 2:
            h ^= data[at + 1] << 8
        h ^= data[at]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the default partitioner sends `key` to, of a topic with `partitions` (0..n-1)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def home_partitions(partitions: int, configured: Collection[int], process_id: int) -> frozenset[int]:
    """The partitions a gateway places its runs on: `configured` ([gateway].event_partitions) where it
    names any of the topic's, else one chosen by the process id (distinct for processes started one
    after another, as a box's gateways are; two that share one both read it, as before)."""
    named = frozenset(p for p in configured if 0 <= p < partitions)
    return named or frozenset({process_id % partitions})


def run_id_on(home: Collection[int], partitions: int,
              draw: Callable[[], uuid.UUID] = uuid.uuid4) -> uuid.UUID:
    """A random run id whose key (its text form, as published) lands on one of `home`; a plain
    random id when `home` names every partition or none (or no draw of MAX_DRAWS landed)."""
    run_id = draw()
    if not home or len(home) >= partitions:
        return run_id
    for _ in range(MAX_DRAWS - 1):
        if partition_of(str(run_id).encode(), partitions) in home:
            return run_id
        run_id = draw()
    return run_id

