"""What serving gRPC costs the gateway's process, alone (issue 9): `python -m bench.bench_grpc_server
[--calls 4000] [--concurrency 8] [--streams 64] [--messages 200] [--tick-ms 20] [--variant aio ...]`.

A server process answers with a servicer that does nothing (no database, no log): a unary method
that decodes a SubmitRequest and answers a SubmitResponse at once, and a server-streaming method that
writes a RunEvent to each of --streams streams every --tick-ms (one ticker hands every stream its
message, as the gateway's live tail fans a batch out), --messages per stream. The client (this
process, grpc.aio) drives it; the figures are the SERVER's CPU-seconds from /proc per unary call and
per streamed message, split by thread (gRPC's poller thread apart from the event loop's), net of the
server's idle CPU over the same time.

Variants (--variant, repeatable; each runs in a fresh server process, in the order given, and
--rounds alternates them):
  aio            grpc.aio as services/main.py builds it (protobuf request/response (de)serializers)
  aio-raw        the same, the stream writing pre-serialized bytes (identity serializer)
  aio-poll       aio with GRPC_POLL_STRATEGY=poll
  h2             services/h2server.py: gRPC on our own HTTP/2 server on the event loop
  h2-raw         the same, writing pre-serialized bytes
Extra environment for a variant: --env NAME=VALUE; a grpc.aio server option: --option NAME=VALUE
(each applies to every variant).

Prints figures only; never fails on timing. CPU-seconds per unit, so a busy box slows it without
skewing it much; alternate variants (--rounds 2+) to see the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from sluice.v1 import admission_pb2, common_pb2, runs_pb2

UNARY = "/bench.Bare/Submit"
STREAM = "/bench.Bare/Stream"
CLK = os.sysconf("SC_CLK_TCK")

VARIANT_ENV = {"aio-poll": {"GRPC_POLL_STRATEGY": "poll"}}


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU-seconds by thread name of process `pid` (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        name = "main" if task == str(pid) else name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- server side ------------------------------------------------------------------------------

EVENT = runs_pb2.RunEvent(run_id="3f2b8c1e-7a4d-4e5f-9b6a-1c2d3e4f5a6b", sequence=7,
                          type=runs_pb2.EVENT_TYPE_DELTA, time_ms=1_764_500_000_000,
                          token_ids=[1234, 5678, 91], text=" the cat", lease_epoch=3)


class Ticker:
    """One task hands every open stream its next message each tick (the gateway tail's fan-out)."""

    def __init__(self, tick_s: float, spread: bool) -> None:
        self.queues: set[asyncio.Queue[object]] = set()
        self.tick_s = tick_s
        self.spread = spread

    async def run(self, item: object) -> None:
        while True:
            if not self.spread:
                await asyncio.sleep(self.tick_s)
                for each in list(self.queues):
                    each.put_nowait(item)
                continue
            # One stream at a time, evenly over the tick: every message is its own wake-up and write.
            queues: list[asyncio.Queue[object] | None] = [*self.queues] or [None]
            for queue in queues:
                await asyncio.sleep(self.tick_s / len(queues))
                if queue is not None:
                    queue.put_nowait(item)


def aio_handlers(ticker: Ticker, raw: bool) -> grpc.GenericRpcHandler:
    response = admission_pb2.SubmitResponse(run_id=EVENT.run_id, status=common_pb2.RUN_STATUS_ACCEPTED,
                                            input_tokens=12)

    async def submit(request: admission_pb2.SubmitRequest, context: grpc.aio.ServicerContext) -> object:
        context.invocation_metadata()
        return response

    async def stream(request: runs_pb2.StreamRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        queue: asyncio.Queue[object] = asyncio.Queue()
        ticker.queues.add(queue)
        try:
            for _ in range(request.after):
                yield await queue.get()
        finally:
            ticker.queues.discard(queue)

    item_serializer = (lambda value: value) if raw else runs_pb2.RunEvent.SerializeToString
    handlers = {
        "Submit": grpc.unary_unary_rpc_method_handler(
            submit, request_deserializer=admission_pb2.SubmitRequest.FromString,
            response_serializer=admission_pb2.SubmitResponse.SerializeToString),
        "Stream": grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=runs_pb2.StreamRequest.FromString,
            response_serializer=item_serializer),
    }
    return grpc.method_handlers_generic_handler("bench.Bare", handlers)


def option_value(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


async def serve(variant: str, port: int, tick_s: float, options: list[str], spread: bool) -> None:
    ticker = Ticker(tick_s, spread)
    raw = variant.endswith("-raw")
    item: object = EVENT.SerializeToString() if raw else EVENT
    if variant.startswith("h2"):
        from sluice.services.h2server import H2Server  # absent on an old checkout
        h2 = H2Server()
        h2.add_generic_rpc_handlers((aio_handlers(ticker, raw),))
        h2.add_insecure_port(f"127.0.0.1:{port}")
        await h2.start()
        server: Any = h2
    else:
        extra = [(name, option_value(value)) for name, value in (pair.split("=", 1) for pair in options)]
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *extra])
        server.add_generic_rpc_handlers((aio_handlers(ticker, raw),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
    ticker_task = asyncio.create_task(ticker.run(item))
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    ticker_task.cancel()
    await server.stop(0)


# --- client side ------------------------------------------------------------------------------

REQUEST = admission_pb2.SubmitRequest(model="tiny-chat", input=b"hello " * 40, max_output_tokens=4)


async def unary_calls(channel: grpc.aio.Channel, calls: int, concurrency: int) -> None:
    call = channel.unary_unary(UNARY, request_serializer=admission_pb2.SubmitRequest.SerializeToString,
                               response_deserializer=admission_pb2.SubmitResponse.FromString)
    metadata = (("authorization", "Bearer sk-bench-000000000000000000000000000000"),)

    async def worker(count: int) -> None:
        for _ in range(count):
            await call(REQUEST, metadata=metadata, timeout=30)

    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))


async def stream_calls(channel: grpc.aio.Channel, streams: int, messages: int) -> int:
    call = channel.unary_stream(STREAM, request_serializer=runs_pb2.StreamRequest.SerializeToString,
                                response_deserializer=lambda data: data)

    async def one() -> int:
        got = 0
        async for _ in call(runs_pb2.StreamRequest(run_id=EVENT.run_id, after=messages), timeout=600):
            got += 1
        return got

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


def net(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


def split(spent: dict[str, float], idle_per_s: float, wall: float, unit: int) -> str:
    total = sum(spent.values()) - idle_per_s * wall
    main = spent.get("main", 0.0)
    others = ", ".join(f"{name} {1e6 * value / unit:.0f}" for name, value in sorted(spent.items())
                       if name != "main" and value > 0)
    return f"{1e6 * total / unit:.0f} us (event loop {1e6 * main / unit:.0f}; {others or 'no other thread'})"


async def measure(variant: str, args: argparse.Namespace) -> None:
    port = free_port()
    env = dict(os.environ, **VARIANT_ENV.get(variant, {}))
    env.update(dict(pair.split("=", 1) for pair in args.env))
    base = variant.replace("-poll", "")
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
        [sys.executable, "-m", "bench.bench_grpc_server", "--serve", base,
                             "--port", str(port), "--tick-ms", str(args.tick_ms),
                             *(f"--option={pair}" for pair in args.option),
                             *(["--spread"] if args.spread else [])],
                            stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise SystemExit(f"{variant}: the server did not start")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await unary_calls(channel, 400, args.concurrency)               # warm-up
            await stream_calls(channel, 4, 20)
            before = thread_cpu(proc.pid)
            await asyncio.sleep(2.0)
            idle = sum(net(before, thread_cpu(proc.pid)).values()) / 2.0
            before, started = thread_cpu(proc.pid), time.monotonic()
            await unary_calls(channel, args.calls, args.concurrency)
            wall = time.monotonic() - started
            unary = split(net(before, thread_cpu(proc.pid)), idle, wall, args.calls)
            before, started = thread_cpu(proc.pid), time.monotonic()
            got = await stream_calls(channel, args.streams, args.messages)
            wall_s = time.monotonic() - started
            streamed = split(net(before, thread_cpu(proc.pid)), idle, wall_s, got)
        print(f"{variant:10s} unary ({args.calls} calls, {args.concurrency} concurrent,"
              f" {args.calls / wall:.0f}/s): "
              f"{unary} per call", flush=True)
        print(f"{variant:10s} stream ({args.streams} x {args.messages}, every {args.tick_ms} ms"
              f"{' spread' if args.spread else ''}, "
              f"{got / wall_s:.0f} msg/s): {streamed} per message; idle {1e3 * idle:.1f} ms CPU/s",
              flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_grpc_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--tick-ms", type=float, default=20.0)
    parser.add_argument("--variant", action="append", default=None)
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--option", action="append", default=[],
                        help="a grpc.aio server option NAME=VALUE for every aio variant (repeatable)")
    parser.add_argument("--spread", action="store_true",
                        help="hand the streams their messages one at a time, evenly over each tick (as a"
                             " gateway's events arrive), not all together")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    import uvloop
    if args.serve:
        uvloop.run(serve(args.serve, args.port, args.tick_ms / 1000, args.option, args.spread))
        return
    print(f"load average {os.getloadavg()[0]:.1f}; server CPU net of its idle, per unit", flush=True)
    for _ in range(args.rounds):
        for variant in args.variant or ["aio", "aio-raw"]:
            uvloop.run(measure(variant, args))


if __name__ == "__main__":
    main()
