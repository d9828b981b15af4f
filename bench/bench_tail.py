"""A gateway's live tail alone: CPU per fetch and per record (issue 9, the gateways' share).

`python -m bench.bench_tail [--rate 200] [--runs 64] [--seconds 10] [--subscribed 0.5]`

This process publishes DELTA events of `--runs` runs round-robin at `--rate` events/s (the
routing worker's producer settings) to a private topic with the configured partition count; a
child process runs one KafkaEventLog's live tail (eventlog/tail.py) with a follower on
`--subscribed` of the runs (a gateway holds about 1/N of the streams of N gateways) and reports
the CPU-seconds it spent (getrusage: robust to a busy box), how many fetch responses its consumer
handled, and the records they carried. Figures per event published, per fetch and per record;
never fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
import uuid

from sluice.services import eventloop

from sluice.config import load_settings
from sluice.eventlog import tail as tail_module
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.interface import LogPosition
from sluice.eventlog.kafka import KafkaEventLog


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def tail_child(bootstrap: str, topic: str, run_ids: list[str], seconds: float) -> None:
    """Follow `run_ids` (each from its first event) for `seconds`; print the CPU and fetch counts."""
    events = KafkaEventLog(bootstrap, topic)
    await events.start()
    fetches = 0

    async def drain(run_id: str) -> None:
        position = LogPosition(await events.partition_of(run_id), 0)
        async for _ in events.follow(run_id, position, 0):
            pass

    # Plus one run that never publishes: the tail runs even when no published run is followed.
    readers = [asyncio.create_task(drain(run_id)) for run_id in [*run_ids, str(uuid.uuid4())]]
    await asyncio.sleep(1.0)
    tail = events.live_tail
    assert tail is not None, "no follower started the tail"
    if hasattr(tail, "fetches"):          # the lean fetcher counts its answers itself
        counted_before = tail.fetches
    else:                                 # a tail on aiokafka's consumer (an older checkout, side by side)
        fetcher = getattr(tail, "_consumer")._fetcher  # noqa: B009 - not an attribute of the new tail
        handle = fetcher._proc_fetch_request          # counted here only: the bench's own window

        async def counted(*args: object, **kwargs: object) -> object:
            nonlocal fetches
            fetches += 1
            return await handle(*args, **kwargs)

        fetcher._proc_fetch_request = counted
    received_before = sum(tail.received.values()) if hasattr(tail, "received") else 0
    print("READY", flush=True)
    started = cpu_s()
    await asyncio.sleep(seconds)
    spent = cpu_s() - started
    received = (sum(tail.received.values()) if hasattr(tail, "received") else 0) - received_before
    if hasattr(tail, "fetches"):
        fetches = tail.fetches - counted_before
    print(json.dumps({"cpu_s": spent, "fetches": fetches, "records": received}), flush=True)
    for reader in readers:
        reader.cancel()
    await events.close()


async def publish(bootstrap: str, topic: str, run_ids: list[str], rate: float, seconds: float) -> int:
    events = KafkaEventLog(bootstrap, topic)
    await events.start()
    sequencers = [RunEventSequencer(run_id) for run_id in run_ids]
    sent = 0
    began = time.monotonic()
    try:
        while time.monotonic() - began < seconds:
            due = int((time.monotonic() - began) * rate)
            while sent < due:
                sequencer = sequencers[sent % len(sequencers)]
                await events.publish(sequencer.delta([1, 2, 3], " a b", int(time.time() * 1000)))
                sent += 1
            await asyncio.sleep(0.002)
    finally:
        await events.close()
    return sent


async def main(args: argparse.Namespace) -> None:
    from bench.platform_stack import create_topic, delete_topic  # heavy imports: not in the child
    config = load_settings()
    bootstrap = config.kafka.bootstrap
    topic = await create_topic(bootstrap, config.kafka.partitions)
    run_ids = [str(uuid.uuid4()) for _ in range(args.runs)]
    followed = run_ids[: round(len(run_ids) * args.subscribed)]
    interval = [] if args.batch_interval_ms is None else [f"--batch-interval-ms={args.batch_interval_ms}"]
    child = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measured window
        [sys.executable, "-m", "bench.bench_tail", "--child", topic, "--seconds", str(args.seconds),
         *[f"--follow={run_id}" for run_id in followed], *interval], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        while child.stdout.readline().strip() != "READY":
            pass
        sent = await publish(bootstrap, topic, run_ids, args.rate, args.seconds)
        figures = json.loads(child.stdout.readline())
    finally:
        child.wait(timeout=30)
        await delete_topic(bootstrap, topic)
    cpu_us = figures["cpu_s"] * 1e6
    fetches, records = max(figures["fetches"], 1), max(figures["records"], 1)
    print(f"tail (batches >= {tail_module.TAIL_BATCH_INTERVAL_MS:g} ms apart): {args.runs} runs at "
          f"{args.rate:.0f} events/s for {args.seconds:.0f} s, {len(followed)} followed "
          f"({args.subscribed:.0%}), {config.kafka.partitions} partitions")
    print(f"  {sent} published, {figures['records']} records reached the tail in {figures['fetches']} "
          f"fetches ({figures['records'] / fetches:.2f} records/fetch)")
    print(f"  tail process CPU {figures['cpu_s'] * 1e3:.0f} ms: {cpu_us / max(sent, 1):.1f} us/event "
          f"published, {cpu_us / fetches:.0f} us/fetch, {cpu_us / records:.1f} us/record")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="events/s published")
    parser.add_argument("--runs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--subscribed", type=float, default=0.5, help="share of the runs followed")
    parser.add_argument("--batch-interval-ms", type=float, default=None,
                        help="the tail's TAIL_BATCH_INTERVAL_MS (default: eventlog/tail.py's)")
    parser.add_argument("--child", metavar="TOPIC", help=argparse.SUPPRESS)
    parser.add_argument("--follow", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch_interval_ms is not None:
        tail_module.TAIL_BATCH_INTERVAL_MS = args.batch_interval_ms
    if args.child:
        eventloop.run(tail_child(load_settings().kafka.bootstrap, args.child, args.follow, args.seconds))
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
