"""Readiness check and idempotent topic creation for the local Kafka broker or cluster
(used by infra/kafka.sh and infra/kafka_cluster.sh; [kafka].brokers says which).

Usage: python infra/kafka_admin.py ready [timeout_s]
       python infra/kafka_admin.py ensure-topic
Reads bootstrap, topic, partitions and retention from the Sluice config (env overrides apply).
"""

from __future__ import annotations

import asyncio
import sys
import time

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from sluice.config import load_settings
from sluice.eventlog.kafka import configured_bootstrap, replication

TOPIC_ALREADY_EXISTS = 36  # Kafka protocol error code


async def _list_topics(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    await admin.start()
    try:
        topics: list[str] = await admin.list_topics()
        return topics
    finally:
        await admin.close()


async def ready(bootstrap: str, timeout_s: float) -> int:
    """A metadata request succeeds, not just the port answering: the broker has joined its quorum."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while time.monotonic() < deadline:
        try:
            topics = await _list_topics(bootstrap)
        except (TimeoutError, KafkaError, OSError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(1)
            continue
        print(f"[kafka] metadata ok at {bootstrap} ({len(topics)} topics)")
        return 0
    print(f"[kafka] ERROR: no metadata from {bootstrap} after {timeout_s:.0f} s ({last_error})",
          file=sys.stderr)
    return 1


async def ensure_topic(bootstrap: str, topic: str, partitions: int, retention_ms: int,
                       replicas: tuple[int, int] = (1, 1)) -> int:
    factor, min_insync = replicas
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
    await admin.start()
    try:
        new_topic = NewTopic(
            name=topic,
            num_partitions=partitions,
            replication_factor=factor,
            topic_configs={"retention.ms": str(retention_ms), "min.insync.replicas": str(min_insync)},
        )
        response = await admin.create_topics([new_topic])
        for name, code, *rest in response.topic_errors:
            if code == TOPIC_ALREADY_EXISTS:
                print(f"[kafka] topic {name} already exists")
            elif code != 0:
                message = rest[0] if rest else ""
                print(f"[kafka] ERROR: creating topic {name} failed: error {code} {message}", file=sys.stderr)
                return 1
            else:
                print(f"[kafka] created topic {name} ({partitions} partitions, replication {factor},"
                      f" min.insync.replicas {min_insync}, retention.ms={retention_ms})")
        described = await admin.describe_topics([topic])
        actual = len(described[0]["partitions"]) if described else 0
        if actual != partitions:
            print(f"[kafka] WARNING: topic {topic} has {actual} partitions, config says {partitions}",
                  file=sys.stderr)
        return 0
    finally:
        await admin.close()


def main(argv: list[str]) -> int:
    config = load_settings().kafka
    bootstrap = configured_bootstrap(config)
    if len(argv) >= 2 and argv[1] == "ready":
        return asyncio.run(ready(bootstrap, float(argv[2]) if len(argv) > 2 else 60.0))
    if len(argv) == 2 and argv[1] == "ensure-topic":
        return asyncio.run(ensure_topic(bootstrap, config.events_topic, config.partitions,
                                        config.retention_ms, replication(config)))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
