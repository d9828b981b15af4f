"""Where a run's events land (eventlog/partitioning.py): the partition Kafka's default partitioner
gives its key, computed here as aiokafka computes it, and run ids drawn to land on a gateway's home
partitions. No broker: aiokafka's own partitioner is the reference."""

from __future__ import annotations

import itertools
import random
import uuid

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from sluice.eventlog.partitioning import MAX_DRAWS, home_partitions, murmur2, partition_of, run_id_on


def test_murmur2_is_kafkas_for_every_length_and_byte_value():
    chosen = random.Random(9)
    samples = [bytes(chosen.randrange(256) for _ in range(length)) for length in range(70) for _ in range(8)]
    samples += [bytes([255]) * 37, bytes(range(256)), str(uuid.UUID(int=0)).encode()]
    for data in samples:
        assert murmur2(data) == aiokafka_murmur2(data) & 0xFFFFFFFF, data


def test_a_run_ids_partition_is_the_one_the_producers_default_partitioner_picks():
    for count in (1, 2, 3, 4, 7, 32):
        partitions = list(range(count))
        for index in range(200):
            key = str(uuid.UUID(int=index * 7919 + count)).encode()
            assert partition_of(key, count) == DefaultPartitioner()(key, partitions, partitions)


def test_a_drawn_run_id_is_a_random_uuid4_whose_key_lands_on_a_home_partition():
    drawn = [run_id_on({1, 3}, 4) for _ in range(300)]
    assert all(run_id.version == 4 for run_id in drawn)
    assert len(set(drawn)) == 300
    landed = {DefaultPartitioner()(str(run_id).encode(), [0, 1, 2, 3], [0, 1, 2, 3]) for run_id in drawn}
    assert landed == {1, 3}                            # both home partitions used, no other


def test_a_home_that_covers_every_partition_or_none_draws_once():
    ids = (uuid.UUID(int=index) for index in itertools.count(1))
    draws = []

    def draw() -> uuid.UUID:
        draws.append(next(ids))
        return draws[-1]

    assert run_id_on({0, 1}, 2, draw) == draws[0] and len(draws) == 1
    assert run_id_on(set(), 4, draw) == draws[1] and len(draws) == 2


def test_a_draw_that_never_lands_home_gives_up_after_max_draws():
    always = uuid.UUID(int=12345)
    away = {partition_of(str(always).encode(), 4)}
    home = set(range(4)) - away - {next(iter(set(range(4)) - away))}   # two partitions it never lands on
    counted = []

    def draw() -> uuid.UUID:
        counted.append(1)
        return always

    assert run_id_on(home, 4, draw) == always
    assert len(counted) == MAX_DRAWS


def test_home_partitions_are_the_configured_ones_of_the_topic_else_one_by_process_id():
    assert home_partitions(4, (0, 2), process_id=7) == {0, 2}
    assert home_partitions(4, (1, 9), process_id=7) == {1}          # 9: not a partition of the topic
    assert home_partitions(4, (), process_id=7) == {3}
    assert home_partitions(4, (8,), process_id=5) == {1}           # none of the topic's: by process id
    assert home_partitions(1, (), process_id=5) == {0}
