"""The lease keeper under faults (DESIGN.md "Leases and fencing": a busy process or a database blip
shorter than the lease never interrupts a healthy run; the ledger's clock alone ends a lease).

- a database that answers every renewal later than a third of the lease, but within it: no lease
  lapses (a renewal is never cut short while it may still save the leases);
- a database stalled (nothing answers, nothing is reset) for most of a lease: no lease lapses;
- the PostgreSQL backend serving the keeper stopped (SIGSTOP) for longer than a lease: a second attempt
  on a fresh connection renews in time;
- the drivers' event loop kept busy for most of a lease: the keeper, on its own thread, renews meanwhile;
- a database stalled longer than the lease: the lease lapses (truly expired by the ledger's clock).

Only a backend of this test's own database is ever stopped (found by the keeper's application_name),
never the shared server's postmaster.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

from sluice.services.routing.leases import APPLICATION_NAME, Lease, Renewed, apply_renewal
from sqlalchemy import func, select, text

from tests.support.ledger_services import Services
from tests.support.tcp_proxy import TcpProxy
from tests.test_routing_leases import INTERVAL_S, LEASE_S, Signals, dsn_of, lease_left_s, queued_run

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

SAMPLE_S = 0.02


def test_a_lease_ends_by_the_ledgers_clock_when_the_answer_came_back_plus_what_was_left():
    # The statement ran between 9.0 (sent) and 9.7 (answered): the ledger's deadline lies in
    # [9.0 + 2.5, 9.7 + 2.5]. Renew before the first; the lease has truly expired only after the second.
    lease = Lease("a", 1, expires_at=10.0)
    apply_renewal([lease], [Renewed("a", True, False, 2.5)], sent_at=9.0, answered_at=9.7)
    assert (lease.expires_at, lease.ends_by) == (11.5, 12.2)
    assert lease.valid(12.1) and not lease.valid(12.2)


async def test_a_database_answering_every_renewal_late_but_within_the_lease_loses_no_lease(api: Services):
    # Each answer 0.9 s late: 45% of the lease, past a third of it (a fixed timeout of lease/3 cut
    # every renewal short and reconnected through the same slow link: no renewal ever landed).
    async with held_lease(api, proxied=True) as (proxy, signals, lease):
        proxy.slow(0.45 * LEASE_S)
        renewed_before = len(signals.lags)
        lapsed = await lapses(lease, 3 * LEASE_S)
        renewed_slowly = len(signals.lags) - renewed_before
        proxy.slow(0.0)
        await asyncio.sleep(INTERVAL_S * 3)
        left = await lease_left_s(api, lease.run_id)
    assert lapsed == [] and renewed_slowly >= 3        # renewed all along, each answer late
    assert signals.refused == [] and left > LEASE_S - 0.6


async def test_a_database_stalled_for_most_of_a_lease_loses_no_lease(api: Services):
    # Nothing answers, nothing is reset, for 0.7 of the lease: the renewal sent meanwhile lands after.
    async with held_lease(api, proxied=True) as (proxy, signals, lease):
        stall = asyncio.create_task(proxy.stall(0.7 * LEASE_S))
        lapsed = await lapses(lease, 0.7 * LEASE_S + INTERVAL_S * 3)
        await stall
        left = await lease_left_s(api, lease.run_id)
    assert proxy.stalls == 1 and lapsed == [] and lease.valid(time.monotonic())
    assert signals.refused == [] and left > LEASE_S - 0.6


async def test_the_keepers_postgres_backend_stopped_longer_than_a_lease_loses_no_lease(api: Services):
    # The database is fine; the one backend serving the keeper hangs (stopped) past the lease's end: a
    # second attempt on a fresh connection renews in time.
    stopped: int | None = None
    async with held_lease(api) as (_, signals, lease):
        try:
            renewals = len(signals.lags)
            await until(lambda: len(signals.lags) > renewals)     # just renewed: its backend is idle
            stopped = await keeper_backend(api)
            os.kill(stopped, signal.SIGSTOP)
            lapsed = await lapses(lease, 1.5 * LEASE_S)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
        await asyncio.sleep(INTERVAL_S * 3)
        left = await lease_left_s(api, lease.run_id)
    assert lapsed == [] and lease.valid(time.monotonic())
    assert signals.refused == [] and left > LEASE_S - 0.6


async def test_a_drivers_loop_busy_for_most_of_a_lease_keeps_its_leases(api: Services):
    async with held_lease(api) as (_, signals, lease):
        renewals = len(signals.lags)
        busy_until = time.monotonic() + 0.75 * LEASE_S
        lapsed_while_busy = False
        while time.monotonic() < busy_until:       # token work that never yields to the loop
            lapsed_while_busy = lapsed_while_busy or not lease.valid(time.monotonic())
        renewed_meanwhile = len(signals.lags) - renewals
        await asyncio.sleep(INTERVAL_S * 2)
    assert not lapsed_while_busy and lease.valid(time.monotonic())
    assert renewed_meanwhile >= 3 and signals.refused == []


async def test_a_database_stalled_longer_than_the_lease_lets_the_lease_lapse_by_the_ledgers_clock(
        api: Services):
    # The driver's verdict: once no renewal answered for a whole lease, the lease has truly expired
    # (ends_by), whatever the keeper still tries; the reaper takes the run from there.
    async with held_lease(api, proxied=True) as (proxy, _, lease):
        stall = asyncio.create_task(proxy.stall(1.5 * LEASE_S))
        lapsed = await lapses(lease, 1.5 * LEASE_S)
        await stall
    assert lapsed and LEASE_S - 2 * INTERVAL_S - 0.1 <= lapsed[0] <= LEASE_S + 0.1, lapsed[:3]


# --- helpers ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def held_lease(api: Services, proxied: bool = False) -> AsyncIterator[tuple[TcpProxy, Signals, Lease]]:
    """A claimed run's lease held by a keeper (reaching PostgreSQL through a proxy when `proxied`),
    once the keeper renewed it a first time."""
    proxy, proxied_dsn = await TcpProxy.before_database(dsn_of(api))
    run_id, epoch = await queued_run(api)
    signals = Signals()
    keeper = signals.keeper(proxied_dsn if proxied else dsn_of(api))
    lease = Lease(run_id, epoch, expires_at=time.monotonic() + LEASE_S)
    keeper.start()
    try:
        signals.hold(keeper, lease)
        await until(lambda: len(signals.lags) >= 1)
        yield proxy, signals, lease
    finally:
        await keeper.close()
        await proxy.close()


async def until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(SAMPLE_S)


async def lapses(lease: Lease, seconds: float) -> list[float]:
    """Watch `lease` for `seconds`: the moments (seconds in) it was not valid."""
    started = time.monotonic()
    lapsed = []
    while (now := time.monotonic()) - started < seconds:
        if not lease.valid(now):
            lapsed.append(round(now - started, 2))
        await asyncio.sleep(SAMPLE_S)
    return lapsed


async def keeper_backend(api: Services) -> int:
    """The pid of the one backend of this test's database serving the lease keeper."""
    async with api.sessionmaker() as session:
        pids = (await session.scalars(text(
            "SELECT pid FROM pg_stat_activity WHERE application_name = :name"
            " AND datname = current_database()"), {"name": APPLICATION_NAME})).all()
        assert await session.scalar(select(func.count()).select_from(text("pg_stat_activity"))) >= 1
    assert len(pids) == 1, pids
    return int(pids[0])
