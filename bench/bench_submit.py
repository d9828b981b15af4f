"""Admission Submit latency on the real PostgreSQL:
`python -m bench.bench_submit [-n 1000] [-c 16] [--tenants 16] [--limits] [--claim-interval-ms 50]`.

Runs Admission in-process (grpc.aio on a free loopback port) against a throwaway database created
on the configured server, migrated with alembic and seeded with the tiny-chat model, and measures
end-to-end Submit latency through the generated stub: authenticate, tokenize, INSERT run +
conditional budget UPDATE in one transaction, COMMIT. Client and server share one process and one
event loop, so the figures include the client's own overhead; on a shared 2-core box they are an
upper bound. Prints figures; never fails on timing.

No routing worker runs, so by default a stand-in claims the backlog the way one would: every
--claim-interval-ms it moves every ACCEPTED run to QUEUED (one UPDATE), so admission's backlog
count sees what it sees in service (the runs of the last interval), and the default
[admission].max_backlog_per_pool never sheds. --claim-interval-ms 0 runs no claimer and raises the
bound above the bench's own submits instead: every submit then counts a backlog of up to all of
them, the worst case of the count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc.aio
from alembic import command
from alembic.config import Config
from sluice.ledger.db import configured_dsn, make_engine, make_sessionmaker
from sluice.ledger.models import Run, RunStatus
from sluice.ledger.seed import TINY_CHAT, TenantSeed, ensure_tenant, upsert_model
from sluice.services.admission import add_admission_servicer
from sqlalchemy import func, update
from sqlalchemy.engine import make_url

from sluice.config import load_settings
from sluice.v1 import admission_pb2, admission_pb2_grpc

BENCH_KEY = "sk-bench-000000000000000000000000000000"
PROMPT = (
    "You are a careful assistant. Summarise the following design note in three bullet points, "
    "keeping every number exact. Sluice admits work under tenant budgets, routes it to replicas, "
    "and streams sequenced events through a durable log so that a client can resume by cursor. "
) * 3


@dataclass(frozen=True, slots=True)
class Figures:
    label: str
    count: int
    wall_s: float
    latencies_ms: list[float]

    def render(self) -> str:
        ordered = sorted(self.latencies_ms)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

        return (
            f"{self.label:<30} n={self.count:<5} p50={pct(50):6.2f} ms  p95={pct(95):6.2f} ms"
            f"  p99={pct(99):6.2f} ms  max={ordered[-1]:6.2f} ms  mean={statistics.fmean(ordered):6.2f} ms"
            f"  throughput={self.count / self.wall_s:7.1f}/s"
        )


def _url(dsn: str, database: str, driver: str | None = None) -> str:
    url = make_url(dsn).set(database=database)
    if driver:
        url = url.set(drivername=driver)
    return url.render_as_string(hide_password=False)


async def _admin(statement: str) -> None:
    connection = await asyncpg.connect(_url(configured_dsn(), make_url(configured_dsn()).database or "sluice",
                                            driver="postgresql"))
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


def _migrate(dsn: str) -> None:
    config = Config(str(Path(__file__).resolve().parents[1] / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", dsn.replace("%", "%%"))
    command.upgrade(config, "head")


def bench_key(tenant: int) -> str:
    return f"{BENCH_KEY}-{tenant}"


async def _prepare(dsn: str, limits: bool, tenants: int) -> None:
    await asyncio.to_thread(_migrate, dsn)
    engine = make_engine(dsn, pool_size=1, max_overflow=0)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            await upsert_model(session, TINY_CHAT)
            # --limits: limits too high to refuse anything, so every submit pays for checking them.
            for tenant in range(tenants):
                bench_tenant = TenantSeed(f"bench-{tenant}", bench_key(tenant), ("standard",),
                                          token_budget=10**12, cost_budget_micros=10**15,
                                          max_concurrent_runs=10**6 if limits else None,
                                          tokens_per_minute=10**12 if limits else None)
                await ensure_tenant(session, bench_tenant, dt.datetime.now(dt.UTC).date().replace(day=1))
    finally:
        await engine.dispose()


async def _submit_timed(stub: admission_pb2_grpc.AdmissionStub, latencies: list[float], key: str) -> None:
    request = admission_pb2.SubmitRequest(
        model="chat", input=PROMPT.encode(), max_output_tokens=64, request_key=uuid.uuid4().hex
    )
    started = time.perf_counter()
    await stub.Submit(request, metadata=(("x-api-key", key),))
    latencies.append((time.perf_counter() - started) * 1000)


async def _sequential(stub: admission_pb2_grpc.AdmissionStub, count: int) -> Figures:
    latencies: list[float] = []
    started = time.perf_counter()
    for _ in range(count):
        await _submit_timed(stub, latencies, bench_key(0))
    return Figures("sequential", count, time.perf_counter() - started, latencies)


async def _concurrent(stub: admission_pb2_grpc.AdmissionStub, count: int, concurrency: int,
                      tenants: int) -> Figures:
    """`concurrency` workers; worker i submits as tenant i mod `tenants` (1: all share one budget row)."""
    latencies: list[float] = []
    remaining = iter(range(count))

    async def worker(index: int) -> None:
        for _ in remaining:
            await _submit_timed(stub, latencies, bench_key(index % tenants))

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    label = f"concurrency {concurrency}, {tenants} tenant{'s' if tenants > 1 else ''}"
    return Figures(label, count, time.perf_counter() - started, latencies)


async def _claim_backlog(dsn: str, interval_s: float, stop: asyncio.Event) -> None:
    """What routing workers do to the backlog (ACCEPTED → QUEUED, queued_at set), minus everything
    else. queued_at is what takes a run out of the unclaimed partial indexes (ledger/models.py
    unclaimed()): with the status alone, Submit's backlog count walked every run claimed so far, and
    PostgreSQL's CPU per Submit grew through the phase (7.4 ms a read by the end of 5,000)."""
    engine = make_engine(dsn, pool_size=1, max_overflow=0)
    try:
        sessions = make_sessionmaker(engine)
        while not stop.is_set():
            async with sessions() as session, session.begin():
                await session.execute(
                    # The unclaimed predicate beside the status: the partial index finds the backlog
                    # (a scan of every run by status grew with the table, ~3 ms by 5,000 runs).
                    update(Run).where(Run.status == RunStatus.ACCEPTED.value, Run.queued_at.is_(None),
                                      Run.finished_at.is_(None))
                    .values(status=RunStatus.QUEUED.value, queued_at=func.clock_timestamp())
                    .execution_options(synchronize_session=False))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        await engine.dispose()


async def run(count: int, concurrency: int, warmup: int, limits: bool = False,
              tenants: int = 1, claim_interval_ms: float = 50.0) -> list[Figures]:
    database = f"sluice_bench_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{database}"')
    dsn = _url(configured_dsn(), database)
    config = load_settings()
    if claim_interval_ms <= 0:
        phases = 2 + (tenants > 1)
        bound = max(config.admission.max_backlog_per_pool, warmup + phases * count + 1)
        config = config.updated(admission={"max_backlog_per_pool": bound})
    stop_claiming = asyncio.Event()
    claimer: asyncio.Task[None] | None = None
    try:
        await _prepare(dsn, limits, max(tenants, 1))
        if claim_interval_ms > 0:
            claimer = asyncio.create_task(_claim_backlog(dsn, claim_interval_ms / 1000, stop_claiming))
        engine = make_engine(dsn, pool_size=max(4, concurrency), max_overflow=0)
        server = grpc.aio.server()
        admission = add_admission_servicer(server, make_sessionmaker(engine), config)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = admission_pb2_grpc.AdmissionStub(channel)
                await _sequential(stub, warmup)  # tokenizer load, pool fill, statement caches
                figures = [await _sequential(stub, count), await _concurrent(stub, count, concurrency, 1)]
                if tenants > 1:
                    figures.append(await _concurrent(stub, count, concurrency, tenants))
                return figures
        finally:
            await server.stop(None)
            await admission.close()
            await engine.dispose()
    finally:
        stop_claiming.set()
        if claimer is not None:
            await claimer
        await _admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Admission Submit latency (real PostgreSQL)")
    parser.add_argument("-n", "--count", type=int, default=1000, help="submits per phase")
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--limits", action="store_true",
                        help="give the tenant (non-binding) concurrency and tokens-per-minute limits")
    parser.add_argument("--tenants", type=int, default=16,
                        help="also run the concurrent phase spread over this many tenants")
    parser.add_argument("--claim-interval-ms", type=float, default=50.0,
                        help="claim the backlog this often, as routing would; 0: never (worst-case count)")
    args = parser.parse_args(argv)
    figures = asyncio.run(run(args.count, args.concurrency, args.warmup, args.limits, args.tenants,
                              args.claim_interval_ms))
    limits = "with" if args.limits else "without"
    backlog = (f"backlog claimed every {args.claim_interval_ms:g} ms" if args.claim_interval_ms > 0
               else "backlog never claimed")
    print(f"Submit latency, prompt of {len(PROMPT)} chars, cap 64, in-process grpc.aio + PostgreSQL,"
          f" tenant {limits} rate limits, {backlog}")
    for figure in figures:
        print(figure.render())


if __name__ == "__main__":
    main()
