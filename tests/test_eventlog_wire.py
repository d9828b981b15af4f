"""The lean read path's hand-written Kafka codec (eventlog/wire.py) against an independent one:
aiokafka's generic protocol structs encode the same requests and build the responses decoded here,
and its record-batch builder writes the batches. No broker."""

from __future__ import annotations

import io

import pytest
from aiokafka.errors import CorruptRecordException, IncompatibleBrokerVersion
from aiokafka.protocol.api import RequestHeader_v1
from aiokafka.protocol.fetch import FetchRequest_v4, FetchResponse_v4
from aiokafka.protocol.offset import OffsetRequest_v1, OffsetResponse_v1
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from sluice.eventlog import wire
from sluice.eventlog.fetcher import RawRequest


def batch(base_offset: int, records: list[tuple[bytes | None, bytes | None]]) -> bytes:
    """One v2 record batch as a producer writes it, at `base_offset` (the broker's offsets)."""
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for delta, (key, value) in enumerate(records):
        builder.append(delta, timestamp=1_700_000_000_000 + delta, key=key, value=value, headers=[])
    raw = bytearray(builder.build())
    raw[0:8] = base_offset.to_bytes(8, "big")        # the broker assigns the base offset
    return bytes(raw)


def test_a_fetch_request_is_byte_for_byte_aiokafkas_v4_request():
    positions = [(0, 17), (3, 0), (2, 1 << 40)]
    ours = wire.fetch_body("sluice.run-events", positions, max_wait_ms=500, min_bytes=1,
                           max_bytes=8 << 20, partition_max_bytes=1 << 20)
    theirs = FetchRequest_v4(-1, 500, 1, 8 << 20, 0,
                             [("sluice.run-events", [(p, o, 1 << 20) for p, o in positions])]).encode()
    assert ours == theirs
    header = RequestHeader_v1(FetchRequest_v4(-1, 0, 0, 0, 0, []), correlation_id=7, client_id="sluice-tail")
    assert wire.request_header(wire.FETCH_API, wire.FETCH_VERSION, 7, "sluice-tail") == header.encode()


def test_a_list_offsets_request_is_byte_for_byte_aiokafkas_v1_request():
    ours = wire.list_offsets_body("events", [1, 0], wire.EARLIEST)
    assert ours == OffsetRequest_v1(-1, [("events", [(1, -2), (0, -2)])]).encode()


def test_a_fetch_response_decodes_to_each_partitions_error_high_watermark_and_records():
    records = batch(40, [(b"run-a", b"e1"), (b"run-b", b"e2")])
    response = FetchResponse_v4(0, [("events", [
        (2, 0, 9, 9, [(5, 3), (6, 4)], b""),             # aborted transactions are skipped over
        (0, 0, 42, 42, [], records),
        (1, 1, -1, -1, None, None),                      # OFFSET_OUT_OF_RANGE, no records
    ])]).encode()
    decoded = wire.decode_fetch(b"\x00\x00\x00\x07" + response, 4)    # past a response header
    assert decoded == [wire.FetchedPartition(2, 0, 9, b""), wire.FetchedPartition(0, 0, 42, records),
                       wire.FetchedPartition(1, 1, -1, b"")]


def test_a_list_offsets_response_decodes_to_each_partitions_error_and_offset():
    response = OffsetResponse_v1([("events", [(0, 0, -1, 120), (3, 6, -1, -1)])]).encode()
    assert wire.decode_list_offsets(response) == {0: (0, 120), 3: (6, -1)}


def test_records_are_handed_over_from_the_fetched_offset_on_and_the_position_moves_past_the_last_batch():
    data = batch(10, [(b"a", b"10"), (b"b", b"11"), (b"a", b"12")]) + batch(13, [(b"c", None), (None, b"14")])
    records, position = wire.decode_records(data, 11)
    # The first batch holds offset 11: the broker answers from its start; 10 was handed over before.
    assert records == [(11, b"b", b"11"), (12, b"a", b"12"), (13, b"c", None), (14, None, b"14")]
    assert position == 15
    assert wire.decode_records(data, 15) == ([], 15)


def test_a_batch_cut_short_at_the_end_of_an_answer_is_left_for_the_next_fetch():
    whole = batch(0, [(b"a", b"0")])
    cut = batch(1, [(b"a", b"1"), (b"a", b"2")])
    records, position = wire.decode_records(whole + cut[:-3], 0)
    assert records == [(0, b"a", b"0")]
    assert position == 1                     # the next fetch asks from 1 and gets the whole batch


def test_a_batch_whose_crc_does_not_match_is_refused():
    damaged = bytearray(batch(0, [(b"a", b"value")]))
    damaged[damaged.index(b"value")] ^= 0x01          # still a well-formed record, its value changed
    with pytest.raises(CorruptRecordException):
        wire.decode_records(bytes(damaged), 0)


def test_a_raw_request_is_checked_against_the_versions_the_broker_answers():
    request = RawRequest(wire.FETCH_API, wire.FETCH_VERSION, b"", wire.decode_fetch)
    assert request.prepare({wire.FETCH_API: (4, 17)}) is request
    with pytest.raises(IncompatibleBrokerVersion):
        request.prepare({wire.FETCH_API: (5, 17)})
    frame = io.BytesIO(b"\x00\x00\x00\x09" + OffsetResponse_v1([("t", [(0, 0, -1, 3)])]).encode())
    listing = RawRequest(wire.LIST_OFFSETS_API, wire.LIST_OFFSETS_VERSION, b"", wire.decode_list_offsets)
    assert listing.parse_response_header(frame).correlation_id == 9
    assert listing.RESPONSE_TYPE.decode(frame) == {0: (0, 3)}
