"""PostgreSQL's CPU per run, statement by statement, without the rest of the stack:
`python -m bench.bench_ledger_run [--runs 600] [--lanes 4] [--batch 1]`.

Each run goes through the ledger's hot statements as the platform sends them (admission's read and
write, the claim transaction, RUNNING, the driver's settlement, terminal published), each kind on its
own connection, so the backend CPU read from /proc/<pid>/schedstat (nanoseconds) is that kind's.
Five more connections LISTEN as the deployed stack's do (two gateways on the events channel; the
routing process on its channels), so NOTIFY's fan-out is paid as it is there. --lanes runs that many
runs at once (each lane its own connections; a lane drives whatever its claim took); --batch N gives
each lane N runs that take their steps together, one statement per step (the routing worker's
batches, ledger/batching.py; 1: a statement per run). Prints backend
CPU per run by statement kind, the runs table's HOT share of updates, and the listeners' CPU.
Never fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg
from sluice.ledger import claims_sql, token_ids
from sluice.ledger.admission_sql import insert_reserving, read_submit_context
from sluice.ledger.channels import CANCEL_CHANNEL, EVENTS_CHANNEL, REPLICAS_CHANNEL, RUNS_ACCEPTED_CHANNEL
from sluice.ledger.models import RunStatus
from sluice.ledger.pg import HotPool, asyncpg_dsn
from sluice.ledger.runs_sql import PublishedMark, RunningMark, mark_published_many, mark_running_many
from sluice.ledger.seed import TINY_CHAT
from sluice.ledger.settlement import settle_owned_many
from sluice.services.finish import Ending, owned_settlement

from bench.platform_stack import create_database, drop_database, tenant_key
from sluice.eventlog.interface import LogPosition

KINDS = ("submit read", "submit write", "claim", "running", "settle", "published")
# The channels each listening connection of the deployed stack LISTENs on (bench-platform: two
# gateways, one routing worker, which shares one connection: services/notify.py); --split-listeners
# gives the routing worker one connection per channel, as before.
LISTENERS_SPLIT = ((EVENTS_CHANNEL,), (EVENTS_CHANNEL,), (RUNS_ACCEPTED_CHANNEL,), (CANCEL_CHANNEL,),
                   (REPLICAS_CHANNEL,))
LISTENERS_MERGED = ((EVENTS_CHANNEL,), (EVENTS_CHANNEL,), (RUNS_ACCEPTED_CHANNEL, CANCEL_CHANNEL,
                                                           REPLICAS_CHANNEL))
OWNER = "bench-ledger:1"
LEASE_S = 10.0


def backend_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0])


def cpu_by_lane(lanes: Sequence[Lane]) -> dict[tuple[int, str], int]:
    return {(i, kind): backend_ns(pid) for i, lane in enumerate(lanes) for kind, pid in lane.pids.items()}


@dataclass
class Lane:
    connections: dict[str, asyncpg.Connection] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    runs: int = 0


async def open_lane(pools: dict[str, HotPool]) -> Lane:
    lane = Lane()
    for kind, pool in pools.items():
        connection = await pool._open()  # noqa: SLF001  (one raw connection per kind, held all along)
        held = await connection.acquire()
        lane.connections[kind] = held
        lane.pids[kind] = int(await held.fetchval("SELECT pg_backend_pid()"))
    return lane


async def submit(lane: Lane, index: int, model: str, tenants: int) -> None:
    tenant = index % tenants
    context = await read_submit_context(lane.connections["submit read"], tenant_key(tenant), model, 1000)
    assert context.caller is not None and context.caller.tenant is not None and context.model is not None
    run = {"id": uuid.uuid4(), "tenant_id": context.caller.tenant.id, "request_key": uuid.uuid4().hex,
           "payload_hash": "x", "model_version": context.model.version,
           "prompt_token_ids": token_ids.pack([5] * 24),
           "input_tokens": 24, "max_output_tokens": 2, "sampling": {}, "conversation_id": None,
           "cache_scope": None, "reserved_tokens": 26, "reserved_cost_micros": 10,
           "api_key_id": context.caller.key_id, "price_card_id": context.model.price_card_id,
           "requested_model": model, "route_reason": "requested", "worker_pool": context.model.worker_pool,
           "quality_tier": context.model.quality_tier, "fallback_from": None, "route_detail": None,
           "traceparent": None, "priority": "interactive"}
    reserved = await insert_reserving(lane.connections["submit write"], run, 60_000,
                                      (RUNS_ACCEPTED_CHANNEL, context.model.worker_pool))
    assert reserved is not None


async def run_group(lane: Lane, indices: Sequence[int], model: str, tenants: int) -> None:
    """Runs submitted one by one, then claimed, RUNNING, settled and published together, each step one
    statement for the whole group (as the routing worker batches runs that reach a step together)."""
    for index in indices:
        await submit(lane, index, model, tenants)
    claim = lane.connections["claim"]
    async with claim.transaction():
        rows = await claims_sql.lock_accepted(claim, max(8, len(indices)))
        queued = await claims_sql.queue_runs(claim, {row["id"]: "replica-0" for row in rows}, OWNER, LEASE_S)
    runs = [(str(run_id), epoch, LogPosition(0, indices[0] * 10 + i))
            for i, (run_id, (_queued_at, epoch)) in enumerate(queued.items())]
    running = await mark_running_many(lane.connections["running"], [
        RunningMark(run_id, epoch, first, 2) for run_id, epoch, first in runs], EVENTS_CHANNEL)
    assert all(running)
    ending = Ending(RunStatus.COMPLETED, 3, 2, None)
    settled = await settle_owned_many(lane.connections["settle"], [
        owned_settlement(run_id, ending, OWNER, LEASE_S, epoch) for run_id, epoch, _ in runs])
    assert all(item.usage is not None for item in settled)
    await mark_published_many(lane.connections["published"], [
        PublishedMark(run_id, 4, LogPosition(0, first.offset + 3)) for run_id, _, first in runs],
        EVENTS_CHANNEL)
    lane.runs += len(runs)


async def listen(dsn: str, channels: Sequence[str]) -> tuple[asyncpg.Connection, int]:
    connection = await asyncpg.connect(dsn)
    for channel in channels:
        await connection.add_listener(channel, lambda *_: None)
    return connection, int(await connection.fetchval("SELECT pg_backend_pid()"))


_UPDATES = """
SELECT pg_stat_get_tuples_updated(c.oid) + pg_stat_get_xact_tuples_updated(c.oid) AS upd,
       pg_stat_get_tuples_hot_updated(c.oid) + pg_stat_get_xact_tuples_hot_updated(c.oid) AS hot
  FROM pg_class c WHERE relname = 'runs'
"""


async def hot_counts(connection: asyncpg.Connection) -> tuple[int, int]:
    row = await connection.fetchrow(_UPDATES)
    assert row is not None
    return int(row["upd"]), int(row["hot"])


async def measure(dsn: str, runs: int, lanes: int, merged: bool, tenants: int, batch: int = 1) -> list[str]:
    pools = {kind: HotPool(dsn, size=lanes) for kind in KINDS}
    listeners = [await listen(asyncpg_dsn(dsn), channels)
                 for channels in (LISTENERS_MERGED if merged else LISTENERS_SPLIT)]
    try:
        opened = [await open_lane(pools) for _ in range(lanes)]
        # Warm up: every statement prepared on every connection, caches filled.
        await asyncio.gather(*(run_group(lane, range(i * batch, (i + 1) * batch), TINY_CHAT.version, tenants)
                               for i, lane in enumerate(opened)))
        stats = opened[0].connections["claim"]
        await asyncio.sleep(0.6)    # statistics are sent at most every 500 ms
        updated, hot = await hot_counts(stats)
        before = cpu_by_lane(opened)
        listened = [backend_ns(pid) for _, pid in listeners]
        done = sum(lane.runs for lane in opened)
        started = time.perf_counter()
        counter = iter(range(lanes * batch, lanes * batch + runs, batch))

        async def drive(lane: Lane) -> None:
            for first in counter:
                await run_group(lane, range(first, first + batch), TINY_CHAT.version, tenants)
        await asyncio.gather(*(drive(lane) for lane in opened))
        wall = time.perf_counter() - started
        after = cpu_by_lane(opened)
        heard = sum(backend_ns(pid) for _, pid in listeners) - sum(listened)
        driven = sum(lane.runs for lane in opened) - done
        await asyncio.sleep(0.6)
        updated2, hot2 = await hot_counts(stats)
        per_kind = {kind: sum(after[i, kind] - before[i, kind] for i in range(lanes)) / driven / 1e3
                    for kind in KINDS}
        total = sum(per_kind.values()) + heard / driven / 1e3
        lines = [f"{driven} runs driven ({runs} submitted) in {wall:.1f} s, {lanes} lanes,"
                 f" {batch} runs a statement,"
                 f" {'merged' if merged else 'split'} listeners ({len(listeners)} connections)",
                 "backend CPU per run (us): " + ", ".join(f"{kind} {us:.0f}" for kind, us in per_kind.items())
                 + f", listeners {heard / driven / 1e3:.0f}; total {total:.0f}",
                 f"runs updates per run {(updated2 - updated) / driven:.2f},"
                 f" HOT {(hot2 - hot) / driven:.2f}"]
        for lane in opened:
            for connection in lane.connections.values():
                await connection.close()
        return lines
    finally:
        for connection, _ in listeners:
            await connection.close()
        for pool in pools.values():
            await pool.close()


async def main_async(args: argparse.Namespace) -> None:
    database, dsn = await create_database(args.tenants)
    try:
        if args.ddl:
            connection = await asyncpg.connect(asyncpg_dsn(dsn))
            try:
                await connection.execute(args.ddl)
            finally:
                await connection.close()
        for line in await measure(dsn, args.runs, args.lanes, not args.split_listeners, args.tenants,
                                  args.batch):
            print(line)
    finally:
        await drop_database(database)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--batch", type=int, default=1,
                        help="runs that take each step together: claimed, RUNNING, settled and published"
                             " by one statement each (the routing worker's batches)")
    parser.add_argument("--split-listeners", action="store_true",
                        help="the routing worker's three channels on three connections (before s12)")
    parser.add_argument("--ddl", default="", help="SQL run on the fresh ledger first (experiments)")
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
