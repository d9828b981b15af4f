"""What one process hop costs on this box, by how long the other side was idle (issue 9, TTFT).

`python -m bench.bench_hops [--requests 200]` (`make bench-hops`: needs the local PostgreSQL and
Kafka of `make infra-up`)

A run's first token crosses about a dozen hops between processes one at a time (client, gateway,
PostgreSQL twice over, the routing worker, the replica, the broker's threads, the gateway's tail).
Each is measured here alone, request after request, with a pause of each length in between:

  pipe      a byte to a child process and back (the box's floor for a wake-up)
  postgres  `SELECT 1` on one asyncpg connection (the ledger's DSN, over its socket where it has one)
  kafka     one record produced with the routing worker's producer settings (idempotent, acks=all,
            linger 0), waited for until acknowledged

On a virtual machine a CPU left idle sleeps, and the side that was idle pays for waking it: the
same request costs several times more after a pause of tens of milliseconds (the TTFT phase's
spacing) than back to back (a loaded platform's). Medians and p95 side by side in one run; never
fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import asyncpg
from aiokafka import AIOKafkaProducer
from sluice.ledger.pg import asyncpg_dsn

from sluice.config import load_settings

GAPS_MS = (0.0, 1.0, 5.0, 20.0, 50.0)
Probe = Callable[[], Awaitable[None]]


def pct(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def timed(probe: Probe, requests: int, gap_s: float) -> list[float]:
    """Each request's latency in seconds, `gap_s` of idleness before each."""
    latencies = []
    for _ in range(requests):
        if gap_s:
            await asyncio.sleep(gap_s)
        started = time.perf_counter()
        await probe()
        latencies.append(time.perf_counter() - started)
    return latencies


class PipeEcho:
    """A child process that answers each byte with one: two wake-ups per round trip, no work."""

    def __init__(self) -> None:
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:
            os.close(self._write)        # else the child holds its own input open and never sees EOF
            os.close(self._read)
            while os.read(to_child, 1):
                os.write(from_child, b".")
            os._exit(0)
        os.close(to_child)
        os.close(from_child)

    async def probe(self) -> None:
        os.write(self._write, b".")
        os.read(self._read, 1)       # blocking on purpose: the event loop adds no wake-up of its own

    def close(self) -> None:
        os.close(self._write)
        os.waitpid(self._pid, 0)
        os.close(self._read)


async def main(requests: int) -> None:
    settings = load_settings()
    topic = settings.kafka.events_topic
    key = f"bench-hops-{uuid.uuid4()}".encode()
    connection = await asyncpg.connect(asyncpg_dsn(settings.database.url))
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks="all",
                                enable_idempotence=True, linger_ms=0)
    pipe = PipeEcho()

    async def select_one() -> None:
        await connection.fetchval("SELECT 1")

    async def produce() -> None:
        await producer.send_and_wait(topic, b"{}", key=key)

    probes: list[tuple[str, Probe]] = [("pipe", pipe.probe), ("postgres", select_one), ("kafka", produce)]
    try:
        await producer.start()
        for _, probe in probes:         # connections, prepared statements, the broker's JIT
            await timed(probe, 50, 0.0)
        print(f"one hop, request after request ({requests} each), after each idle gap:"
              f" p50 / p95 in ms [load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs]")
        print(f"{'gap':>8} " + "".join(f"{name:>18}" for name, _ in probes))
        for gap_ms in GAPS_MS:
            cells = []
            for _, probe in probes:
                latencies = await timed(probe, requests, gap_ms / 1000)
                cells.append(f"{pct(latencies, 50) * 1e3:8.3f} /{pct(latencies, 95) * 1e3:7.3f}")
            print(f"{gap_ms:>5.0f} ms " + "".join(f"{cell:>18}" for cell in cells))
    finally:
        await producer.stop()
        await connection.close()
        pipe.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.bench_hops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests per probe and gap")
    asyncio.run(main(parser.parse_args().requests))
