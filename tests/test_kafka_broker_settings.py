"""The broker that infra/kafka.sh starts (dev, CI) runs with the settings chosen for a small box, and
the client settings of [kafka] reach the producer (issue 9: the broker's CPU per event and idle).

A throwaway broker of its own (ports, data dir: never the shared one), started with its request log
on, which is also how bench_platform --request-log counts requests per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.partitioner import DefaultPartitioner

from bench.bench_platform import RequestCounter
from bench.platform_stack import kafka_pid
from sluice.config import load_settings
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import common_pb2
from tests.test_chaos_infra import single_broker

pytestmark = pytest.mark.integration

# What infra/kafka.sh gives the broker (its comments say why).
JVM_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
BROKER_PROPERTIES = {"num.network.threads": "1", "num.io.threads": "2",
                     "metadata.max.idle.interval.ms": "5000"}


@pytest.fixture(scope="module")
def broker() -> Iterator[dict[str, str]]:
    with single_broker("settings-kafka", KAFKA_REQUEST_LOG="debug") as env:
        yield env


@pytest.fixture
async def events(broker: dict[str, str]) -> AsyncIterator[KafkaEventLog]:
    config = load_settings(environ={**os.environ, **broker, "SLUICE_KAFKA__PRODUCER_LINGER_MS": "17"})
    log = KafkaEventLog.from_config(config)
    await log.start()
    try:
        yield log
    finally:
        await log.close()


def test_the_broker_jvm_runs_c1_only_with_the_serial_collector(broker):
    pid = int((Path(broker["SLUICE_PATHS__DATA_DIR"]) / "kafka" / "kafka.pid").read_text())
    arguments = (Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
    assert all(flag in arguments for flag in JVM_FLAGS), arguments
    # bench_platform measures this broker, not the shared one nor the first JVM it finds.
    assert kafka_pid(broker["SLUICE_KAFKA__BOOTSTRAP"]) == pid


async def test_the_broker_runs_with_the_small_box_thread_counts_and_idle_interval(broker):
    admin = AIOKafkaAdminClient(bootstrap_servers=broker["SLUICE_KAFKA__BOOTSTRAP"])
    await admin.start()
    try:
        [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, "1")])
    finally:
        await admin.close()
    [resource] = response.resources
    values = {entry[0]: entry[1] for entry in resource[4]}
    assert {name: values.get(name) for name in BROKER_PROPERTIES} == BROKER_PROPERTIES


async def test_the_producer_lingers_as_configured_and_each_request_is_in_the_request_log(broker, events):
    await events.start()
    assert events._writer is not None and events._writer.linger_s == 17 / 1000
    counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
    counter.mark()
    seq = RunEventSequencer(str(uuid.uuid4()))
    for _ in range(3):   # appended one by one: three produce requests, acknowledged
        await events.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    # The broker logs a request once its response is sent: the last line may follow the ack.
    for _ in range(50):
        if counter.counts().get("produce", 0) >= 3:
            break
        await asyncio.sleep(0.1)
    assert counter.counts().get("produce") == 3


async def produce_requests(counter: RequestCounter, at_least: int) -> int:
    """Produce requests logged since counter.mark() once `at_least` are in (the broker logs a request
    once its response is sent: the last line may follow the ack), plus any that follow shortly."""
    for _ in range(50):
        if counter.counts().get("produce", 0) >= at_least:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    return counter.counts().get("produce", 0)


def runs_over_partitions(events: KafkaEventLog, partitions: list[int], runs_each: int) -> list[str]:
    """Run ids whose events land in each of `partitions`, `runs_each` per partition."""
    wanted = {partition: runs_each for partition in partitions}
    found: list[str] = []
    while any(wanted.values()):
        run_id = str(uuid.uuid4())
        partition = int(DefaultPartitioner()(run_id.encode(), partitions, partitions))
        if wanted[partition]:
            wanted[partition] -= 1
            found.append(run_id)
    return found


@contextlib.asynccontextmanager
async def lingering_log(broker: dict[str, str], linger_ms: int) -> AsyncIterator[KafkaEventLog]:
    linger = {"SLUICE_KAFKA__PRODUCER_LINGER_MS": str(linger_ms)}
    log = KafkaEventLog.from_config(load_settings(environ={**os.environ, **broker, **linger}))
    await log.start()
    try:
        yield log
    finally:
        await log.close()


async def test_the_events_of_every_run_published_within_one_linger_leave_in_one_produce_request(broker):
    async with lingering_log(broker, 400) as events:
        partitions = sorted(await (await events._ready_producer()).partitions_for(events.topic))
        assert len(partitions) > 1, "the point is a request carrying several partitions"
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        sequencers = [RunEventSequencer(run_id) for run_id in runs_over_partitions(events, partitions, 3)]
        counter.mark()
        # Each run's event 20 ms after the previous run's: ~240 ms in all, within the 400 ms linger
        # that the first one opened. One window, so one produce request to the one broker carries
        # every partition's batch (a linger per partition's batch would send one as each ends).
        acks = []
        for seq in sequencers:
            acks.append(await events.publish(seq.status(common_pb2.RUN_STATUS_RUNNING, 0)))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(asyncio.gather(*acks), 10)
        assert await produce_requests(counter, 1) == 1


async def test_a_first_token_sends_the_whole_open_window_at_once(broker):
    """At once means the window leaves now, every partition of it: one request, no linger waited."""
    async with lingering_log(broker, 3000) as events:
        partitions = sorted(await (await events._ready_producer()).partitions_for(events.topic))
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        others = [RunEventSequencer(run_id) for run_id in runs_over_partitions(events, partitions, 2)]
        first = RunEventSequencer(str(uuid.uuid4()))
        counter.mark()
        acks = [await events.publish(seq.status(common_pb2.RUN_STATUS_RUNNING, 0)) for seq in others]
        acks.append(await events.publish(first.delta([7], "x", 0), at_once=True))
        await asyncio.wait_for(asyncio.gather(*acks), 1.5)    # half the linger
        assert await produce_requests(counter, 1) == 1
