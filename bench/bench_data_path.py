"""CPU per token of the routing worker's two per-token hot paths, each alone in this process
(issue 9.1): `python -m bench.bench_data_path [--streams 64] [--tokens 100]`.

  replica   the replica read path over --streams concurrent streams from one simple-engine Triton
            replica at --token-delay-ms per step (one gRPC message per token per stream, as
            TensorRT-LLM streams), both ways replica_client offers it: `generate` (chunks pushed
            from the shared HTTP/2 connection's reader, the driver's path) and `stream_generate`
            (an async iterator: a task wake-up per chunk); this process's CPU per token
            (getrusage), the replica's apart. (grpc.aio, before services/replica_conn.py: ~85 us
            per token for a bare read loop, ~100 through the client's layers.)
  driver    RunDriver's loop (services/routing/driver.py) with the driver tests' in-memory event log,
            ledger and scripted replica (tests/test_routing_driver.py): --streams runs of --tokens
            tokens at --driver-gap-ms per token, windows of --window-ms; CPU per token and per event,
            net of the scripted replica's own cost (measured alone first).
  publish   the driver's hand-off to the event log alone: KafkaEventLog.publish of --streams runs'
            DELTA events (--tokens/--tokens-per-event per run, one every --publish-gap-ms per run, each
            run keeping its events in flight and awaiting them at its end, as the driver does) to a
            private topic on the broker at --bootstrap; this process's CPU per event (the broker's apart).

Prints figures only; never fails on timing. CPU-seconds, so a busy box slows it without skewing it
much; run it twice to see the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import resource
import tempfile
import time
from pathlib import Path

import uvloop
from sluice.services import replica_client

from bench.bench_replica import start_replica, stop_replica
from bench.platform_stack import create_topic, delete_topic
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.kafka import KafkaEventLog

# The driver tests' fakes, imported by name so that the type check of bench/ does not extend to tests/.
fakes = importlib.import_module("tests.test_routing_driver")
MemoryLog, Script, ScriptedReplicas, driver_for = (fakes.MemoryLog, fakes.Script, fakes.ScriptedReplicas,
                                                   fakes.driver_for)

PROMPT_IDS = list(range(1, 9))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def read_streams(address: str, streams: int, tokens: int) -> int:
    async def one(index: int) -> int:
        received = 0
        async for chunk in replica_client.stream_generate(address, f"bench-{index}-{time.time_ns()}",
                                                          PROMPT_IDS, tokens):
            received += len(chunk.token_ids)
        return received

    return sum(await asyncio.gather(*(one(index) for index in range(streams))))


async def push_streams(address: str, streams: int, tokens: int) -> int:
    async def one(index: int) -> int:
        received = [0]

        def take(chunk: replica_client.TokenChunk) -> None:
            received[0] += len(chunk.token_ids)

        await replica_client.generate(address, f"bench-push-{index}-{time.time_ns()}", PROMPT_IDS, tokens,
                                      on_chunk=take)
        return received[0]

    return sum(await asyncio.gather(*(one(index) for index in range(streams))))


async def replica_path(args: argparse.Namespace, address: str) -> None:
    await read_streams(address, 4, 4)                        # connection and replica warm
    for _ in range(args.rounds):
        for way, read in (("pushed (generate)", push_streams), ("iterated (stream_generate)", read_streams)):
            started, wall = cpu_seconds(), time.perf_counter()
            received = await read(address, args.streams, args.tokens)
            spent, wall = cpu_seconds() - started, time.perf_counter() - wall
            print(f"replica reads, {way}: {args.streams} streams x {args.tokens} tokens ({received} received,"
                  f" {wall:.1f} s wall): {spent / received * 1e6:.1f} us CPU per token", flush=True)
    await replica_client.close_channels()


async def scripted_alone(streams: int, tokens: int, gap_s: float) -> None:
    async def one() -> None:
        replicas = ScriptedReplicas({"r0": Script([(1,)] * tokens, gap_s=gap_s)})
        async for _ in replicas.stream_generate("r0", "bench", PROMPT_IDS, tokens):
            pass

    await asyncio.gather(*(one() for _ in range(streams)))


async def drivers(streams: int, tokens: int, gap_s: float, window_ms: float) -> int:
    """Events published by `streams` drivers, each with its own log (acknowledged 4 ms later)."""
    async def one() -> int:
        replicas = ScriptedReplicas({"r0": Script([(1,)] * tokens, gap_s=gap_s)})
        log = MemoryLog(ack_delay_s=0.004)
        driver, _, _ = driver_for(replicas, log, window_ms=window_ms)
        await driver.run()
        return len(log.events)

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


async def driver_path(args: argparse.Namespace) -> None:
    gap_s = args.driver_gap_ms / 1000
    for _ in range(args.rounds):
        started = cpu_seconds()
        await scripted_alone(args.streams, args.tokens, gap_s)
        replica = cpu_seconds() - started
        started = cpu_seconds()
        events = await drivers(args.streams, args.tokens, gap_s, args.window_ms)
        spent = cpu_seconds() - started - replica
        tokens = args.streams * args.tokens
        print(f"driver loop: {args.streams} runs x {args.tokens} tokens at {args.driver_gap_ms:g} ms/token,"
              f" {args.window_ms:g} ms windows ({events} events, {tokens / events:.2f} tokens/event):"
              f" {spent / tokens * 1e6:.1f} us CPU per token, {spent / events * 1e6:.1f} us per event",
              flush=True)


async def publishers(log: KafkaEventLog, streams: int, events: int, gap_s: float, tokens: int) -> int:
    async def one(index: int) -> int:
        sequencer = RunEventSequencer(f"bench-publish-{index}-{time.time_ns()}", epoch=1)
        acks = []
        for _ in range(events):
            event = sequencer.delta(list(range(tokens)), "tok " * tokens, int(time.time() * 1000))
            acks.append(await log.publish(event))
            await asyncio.sleep(gap_s)
        await asyncio.wait(acks)
        return len(acks)

    return sum(await asyncio.gather(*(one(index) for index in range(streams))))


async def publish_path(args: argparse.Namespace) -> None:
    topic = await create_topic(args.bootstrap, 8)
    log = KafkaEventLog(args.bootstrap, topic)
    try:
        await log.start()
        await publishers(log, 8, 2, 0.0, 1)                # producer warm, partitions known
        per_run = max(1, round(args.tokens / args.tokens_per_event))
        for _ in range(args.rounds):
            started, wall = cpu_seconds(), time.perf_counter()
            events = await publishers(log, args.streams, per_run, args.publish_gap_ms / 1000,
                                      round(args.tokens_per_event))
            spent, wall = cpu_seconds() - started, time.perf_counter() - wall
            print(f"publish: {args.streams} runs x {per_run} events every {args.publish_gap_ms:g} ms"
                  f" ({events} events, {wall:.1f} s wall): {spent / events * 1e6:.1f} us CPU per event",
                  flush=True)
    finally:
        await log.close()
        await delete_topic(args.bootstrap, topic)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_data_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--token-delay-ms", type=int, default=100, help="the replica's step")
    parser.add_argument("--driver-gap-ms", type=float, default=10.0)
    parser.add_argument("--window-ms", type=float, default=25.0)
    parser.add_argument("--tokens-per-event", type=float, default=2.5, help="publish: tokens per DELTA")
    parser.add_argument("--publish-gap-ms", type=float, default=250.0, help="publish: a run's event spacing")
    parser.add_argument("--bootstrap", default="127.0.0.1:19092", help="publish: the Kafka broker")
    parser.add_argument("--only", choices=("replica", "driver", "publish"), default=None)
    args = parser.parse_args(argv)
    if args.only in (None, "driver"):
        uvloop.run(driver_path(args))
    if args.only in (None, "publish"):
        uvloop.run(publish_path(args))
    if args.only in (None, "replica"):
        with tempfile.TemporaryDirectory(prefix="bench-data-path-") as folder:
            process, address = start_replica({"engine": "simple", "token_delay_ms": args.token_delay_ms},
                                             Path(folder) / "replica.log")
            try:
                uvloop.run(replica_path(args, address))
            finally:
                stop_replica(process)


if __name__ == "__main__":
    main()
