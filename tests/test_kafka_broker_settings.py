"""The broker that infra/kafka.sh starts (dev, CI) runs with the settings chosen for a small box, and
the client settings of [kafka] reach the producer (issue 9: the broker's CPU per event and idle).

A throwaway broker of its own (ports, data dir: never the shared one), started with its request log
on, which is also how bench_platform --request-log counts requests per event.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

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

