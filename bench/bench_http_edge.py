"""The HTTP edge's added latency over the gRPC door, side by side on the real PostgreSQL:
`python -m bench.bench_http_edge [-n 500] [--loop uvloop|asyncio]` (`make bench-http`).

One process serves Admission and Runs over grpc.aio and the HTTP edge over uvicorn, both on the
same service objects, database pool and event loop, as the gateway does. The bench then makes
the same request through each door, one at a time and alternating (so both see the same database
and box), with keep-alive clients (the generated gRPC stub; aiohttp):

    submit   gRPC Admission.Submit          vs  POST /v1/inference          (write: run + reservation)
    get run  gRPC Runs.GetRun               vs  GET  /v1/runs/{id}          (read)

and prints p50/p95/p99 per door and the difference (HTTP minus gRPC). The target is an added
p95 of at most 3 ms one at a time (issue 11). Client and server share the process and its loop,
so both doors also pay their own client; on a shared 2-core box the figures are an upper bound.
Never fails on timing. A stand-in claimer moves the backlog to QUEUED as routing workers would
(bench_submit), so admission's backlog count stays what it is in service.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import grpc.aio
from sluice.ledger.db import configured_dsn, make_engine, make_sessionmaker
from sluice.services.admission import add_admission_servicer
from sluice.services.edge.server import EdgeServer
from sluice.services.edge.settings import HttpSettings
from sluice.services.edge.templates import ModelCards
from sluice.services.edge.web import EdgeServices
from sluice.services.runs import add_runs_servicer
from sluice.services.usage import UsageQueryService
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench.bench_submit import PROMPT, _admin, _claim_backlog, _prepare, _url, bench_key
from sluice.config import Settings, load_settings
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import admission_pb2, admission_pb2_grpc, runs_pb2, runs_pb2_grpc

CAP = 64
TARGET_ADDED_P95_MS = 3.0


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def _timed(call: Callable[[], Awaitable[object]], into: list[float]) -> object:
    started = time.perf_counter()
    result = await call()
    into.append((time.perf_counter() - started) * 1000)
    return result


class Doors:
    """The same requests through the gRPC stubs and over HTTP."""

    def __init__(self, channel: grpc.aio.Channel, http: aiohttp.ClientSession, url: str, key: str) -> None:
        self._admission = admission_pb2_grpc.AdmissionStub(channel)
        self._runs = runs_pb2_grpc.RunsStub(channel)
        self._http = http
        self._url = url
        self._metadata = (("authorization", f"Bearer {key}"),)
        self._headers = {"authorization": f"Bearer {key}"}

    async def grpc_submit(self) -> str:
        request = admission_pb2.SubmitRequest(model="chat", input=PROMPT.encode(), max_output_tokens=CAP,
                                              request_key=uuid.uuid4().hex)
        return str((await self._admission.Submit(request, metadata=self._metadata)).run_id)

    async def http_submit(self) -> str:
        body = {"model": "chat", "input": PROMPT, "maxOutputTokens": CAP, "requestKey": uuid.uuid4().hex}
        async with self._http.post(f"{self._url}/v1/inference", json=body, headers=self._headers) as reply:
            assert reply.status == 202, await reply.text()
            return str((await reply.json())["runId"])

    async def grpc_get(self, run_id: str) -> None:
        await self._runs.GetRun(runs_pb2.GetRunRequest(run_id=run_id), metadata=self._metadata)

    async def http_get(self, run_id: str) -> None:
        async with self._http.get(f"{self._url}/v1/runs/{run_id}", headers=self._headers) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()


async def measure(doors: Doors, count: int) -> dict[str, list[float]]:
    names = ("grpc submit", "http submit", "grpc get", "http get")
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(count):
        # Alternate which door goes first, so neither always meets a warmer cache.
        pairs = [("grpc", doors.grpc_submit, doors.grpc_get), ("http", doors.http_submit, doors.http_get)]
        for door, submit, get in (pairs if i % 2 == 0 else pairs[::-1]):
            run_id = await _timed(submit, samples[f"{door} submit"])
            await _timed(lambda: get(str(run_id)), samples[f"{door} get"])   # noqa: B023 - awaited at once
    return samples


def report(samples: dict[str, list[float]], count: int, loop: str) -> str:
    lines = [f"HTTP edge vs gRPC, one request at a time, n={count} each, {loop} loop, prompt of"
             f" {len(PROMPT)} chars, cap {CAP} (in-process servers + clients, real PostgreSQL)"]
    for name, values in samples.items():
        lines.append(f"  {name:<12} p50={pct(values, 50):6.2f} ms  p95={pct(values, 95):6.2f} ms"
                     f"  p99={pct(values, 99):6.2f} ms  mean={statistics.fmean(values):6.2f} ms")
    for what in ("submit", "get"):
        grpc_values, http_values = samples[f"grpc {what}"], samples[f"http {what}"]
        added_p50 = pct(http_values, 50) - pct(grpc_values, 50)
        added_p95 = pct(http_values, 95) - pct(grpc_values, 95)
        # Each HTTP request ran right beside its gRPC twin: their difference cancels most box noise.
        paired = [h - g for h, g in zip(http_values, grpc_values, strict=True)]
        verdict = "within" if added_p95 <= TARGET_ADDED_P95_MS else "OVER"
        lines.append(f"  added by HTTP, {what:<6}: p95 {added_p95:+6.2f} ms ({verdict} the"
                     f" {TARGET_ADDED_P95_MS:g} ms target), p50 {added_p50:+6.2f} ms;"
                     f" paired differences p50 {pct(paired, 50):+6.2f} ms")
    return "\n".join(lines)


async def serve_and_measure(sessions: async_sessionmaker[AsyncSession], config: Settings, count: int,
                            warmup: int) -> dict[str, list[float]]:
    events = KafkaEventLog.from_config(config)     # GetRun never reads the log; never started
    server = grpc.aio.server()
    admission = add_admission_servicer(server, sessions, config)
    runs = add_runs_servicer(server, sessions, config, events)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    settings = HttpSettings.from_config(config.updated(http={"listen": "127.0.0.1:0"}))
    edge = EdgeServer(EdgeServices(admission, runs, UsageQueryService(sessions), sessions,
                                   ModelCards(sessions, settings.model_card_ttl_s), settings))
    await edge.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
            doors = Doors(channel, http, edge.address, bench_key(0))
            await measure(doors, warmup)      # tokenizer, pools, statement caches, connections
            return await measure(doors, count)
    finally:
        await edge.stop()
        await server.stop(None)
        await admission.close()
        await runs.close()


async def run(count: int, warmup: int) -> dict[str, list[float]]:
    database = f"sluice_bench_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{database}"')
    dsn = _url(configured_dsn(), database)
    config = load_settings().updated(database={"dsn": dsn})
    stop = asyncio.Event()
    claimer: asyncio.Task[None] | None = None
    try:
        await _prepare(dsn, limits=False, tenants=1)
        claimer = asyncio.create_task(_claim_backlog(dsn, 0.05, stop))
        engine = make_engine(dsn, pool_size=4, max_overflow=0)
        try:
            return await serve_and_measure(make_sessionmaker(engine), config, count, warmup)
        finally:
            await engine.dispose()
    finally:
        stop.set()
        if claimer is not None:
            await claimer
        await _admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="HTTP edge latency added over gRPC, side by side")
    parser.add_argument("-n", "--count", type=int, default=500, help="requests of each kind per door")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop
        samples = uvloop.run(run(args.count, args.warmup))
    else:
        samples = asyncio.run(run(args.count, args.warmup))
    print(report(samples, args.count, args.loop))


if __name__ == "__main__":
    main()
