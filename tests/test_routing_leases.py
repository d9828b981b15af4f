"""Leases on real PostgreSQL (DESIGN.md "Leases and fencing"): the lease keeper renews every lease
of the process in one statement from its own connection, keeps leases through a database outage
shorter than the lease, refuses a lease whose epoch moved on, and carries cancels; a renewal
never waits for a row another transaction holds."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
from sluice.ledger.db import dsn_of as ledger_dsn_of
from sluice.ledger.models import Model, Run, RunStatus
from sluice.ledger.pg import KnownTypesConnection, asyncpg_dsn
from sluice.services.routing.claims import mark_queued
from sluice.services.routing.leases import (
    RENEW_SQL,
    WEDGED_LEASES,
    Lease,
    LeaseKeeper,
    Renewed,
    apply_renewal,
)
from sqlalchemy import func, select, update

from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, prompt_of
from tests.support.ledger_services import Services
from tests.support.tcp_proxy import TcpProxy

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

LEASE_S = 2.0
INTERVAL_S = 0.2


# --- the pure part ------------------------------------------------------------------------------


def test_a_renewal_moves_the_deadline_to_when_it_was_sent_plus_what_the_ledger_says_is_left():
    lease = Lease("a", 1, expires_at=10.0)
    refused, cancelled = apply_renewal([lease], [Renewed("a", True, False, 2.5)], sent_at=9.0)
    assert (lease.expires_at, refused, cancelled) == (11.5, [], [])


def test_a_deadline_never_moves_back_and_a_skipped_row_keeps_its_deadline():
    lease = Lease("a", 1, expires_at=10.0)
    apply_renewal([lease], [Renewed("a", True, False, 0.5)], sent_at=9.0)
    apply_renewal([lease], [Renewed("a", True, False, None)], sent_at=9.8)
    assert lease.expires_at == 10.0 and not lease.refused


def test_a_run_no_longer_ours_is_refused_and_a_cancel_is_reported_once():
    gone, cancelled = Lease("gone", 1, expires_at=10.0), Lease("c", 1, expires_at=10.0)
    rows = [Renewed("gone", False, False, None), Renewed("c", True, True, 2.0)]
    first = apply_renewal([gone, cancelled], rows, sent_at=9.0)
    second = apply_renewal([cancelled], rows[1:], sent_at=9.5)
    assert first == ([gone], [cancelled]) and second == ([], [])
    assert gone.refused and not gone.valid(0.0)


# --- on PostgreSQL ------------------------------------------------------------------------------


async def queued_run(api: Services) -> tuple[str, int]:
    """A submitted run, claimed as a routing worker claims it (lease of LEASE_S, epoch 1)."""
    async with api.sessionmaker() as session, session.begin():
        if await session.get(Model, DEFAULT_MODEL.version) is None:
            await add_model(session, api.tokenizer)
        tenant = await add_tenant(session, f"t{uuid.uuid4().hex[:6]}")
    response = await api.submit(tenant, prompt_of(4), 8)
    async with api.sessionmaker() as session, session.begin():
        _, epoch = await mark_queued(session, uuid.UUID(response.run_id), "r0", "me:1:a", LEASE_S)
    return response.run_id, epoch


async def lease_left_s(api: Services, run_id: str) -> float:
    async with api.sessionmaker() as session:
        expires, now = (await session.execute(
            select(Run.lease_expires_at, func.now()).where(Run.id == uuid.UUID(run_id)))).one()
    return float((expires - now).total_seconds())


def dsn_of(api: Services) -> str:
    return ledger_dsn_of(api.sessionmaker)


class Signals:
    def __init__(self) -> None:
        self.refused: list[str] = []
        self.cancelled: list[str] = []
        self.lags: list[float] = []
        self.failures = 0

    def keeper(self, dsn: str) -> LeaseKeeper:
        keeper = LeaseKeeper(dsn, LEASE_S, INTERVAL_S)
        keeper.on_renewed = self.lags.append

        def failed() -> None:
            self.failures += 1
        keeper.on_failed = failed
        return keeper

    def hold(self, keeper: LeaseKeeper, lease: Lease) -> None:
        keeper.hold(lease, lambda: self.refused.append(lease.run_id),
                    lambda: self.cancelled.append(lease.run_id))


async def test_the_keeper_renews_every_held_lease_and_records_durable_progress(api: Services):
    runs = [await queued_run(api) for _ in range(3)]
    signals = Signals()
    keeper = signals.keeper(dsn_of(api))
    leases = [Lease(run_id, epoch, expires_at=time.monotonic() + LEASE_S) for run_id, epoch in runs]
    leases[0].last_sequence, leases[0].output_tokens = 7, 6
    keeper.start()
    try:
        for lease in leases:
            signals.hold(keeper, lease)
        await asyncio.sleep(LEASE_S * 1.5)
        left = [await lease_left_s(api, run_id) for run_id, _ in runs]
        now = time.monotonic()
    finally:
        await keeper.close()
    assert all(lease.valid(now) for lease in leases)           # past the first lease, still valid
    assert all(LEASE_S - 0.6 < seconds <= LEASE_S for seconds in left)
    assert signals.refused == [] and signals.failures == 0 and len(signals.lags) >= 5
    row = await api_run(api, runs[0][0])
    assert (row.last_sequence, row.output_tokens) == (7, 6)


async def test_a_keeper_idle_for_longer_than_a_lease_renews_its_first_lease_from_when_it_ran(api: Services):
    # A keeper's connection is made (and its statement prepared) when it starts; its first lease may
    # come much later. With the statement's types already known to the process (an earlier keeper),
    # the renewal ran in a transaction begun at that prepare and dated the lease back by the idle time:
    # the run's lease had expired by the ledger's clock at its first renewal, and a reaper took it.
    primer = await asyncpg.connect(asyncpg_dsn(dsn_of(api)), connection_class=KnownTypesConnection)
    await primer.prepare(RENEW_SQL)         # the renewal statement's types are now known to the process
    await primer.close()
    run_id, epoch = await queued_run(api)
    signals = Signals()
    keeper = signals.keeper(dsn_of(api))
    keeper.start()
    try:
        await asyncio.sleep(LEASE_S * 1.5)  # idle: nothing held yet
        signals.hold(keeper, Lease(run_id, epoch, expires_at=time.monotonic() + LEASE_S))
        lags = len(signals.lags)
        for _ in range(int(LEASE_S / INTERVAL_S) * 4):    # until the first renewal of that lease
            if len(signals.lags) > lags:
                break
            await asyncio.sleep(INTERVAL_S / 4)
        left = await lease_left_s(api, run_id)
    finally:
        await keeper.close()
    # Renewed a moment ago for LEASE_S: at most a renewal interval (and this read) has passed since.
    assert LEASE_S - 2 * INTERVAL_S < left <= LEASE_S, left
    assert signals.refused == []


async def api_run(api: Services, run_id: str) -> Run:
    async with api.sessionmaker() as session:
        run = await session.get(Run, uuid.UUID(run_id))
        assert run is not None
        return run


async def test_a_lease_whose_epoch_moved_on_is_refused_and_a_cancel_is_carried(api: Services):
    (taken, epoch), (cancelled, epoch2) = await queued_run(api), await queued_run(api)
    async with api.sessionmaker() as session, session.begin():
        # A reaper took the first run over; Runs.Cancel asked for the second to stop.
        await session.execute(update(Run).where(Run.id == uuid.UUID(taken)).values(lease_epoch=epoch + 1))
        await session.execute(update(Run).where(Run.id == uuid.UUID(cancelled))
                              .values(cancel_requested_at=func.now()))
    signals = Signals()
    keeper = signals.keeper(dsn_of(api))
    keeper.start()
    try:
        signals.hold(keeper, Lease(taken, epoch, expires_at=time.monotonic() + LEASE_S))
        signals.hold(keeper, Lease(cancelled, epoch2, expires_at=time.monotonic() + LEASE_S))
        await asyncio.sleep(INTERVAL_S * 4)
    finally:
        await keeper.close()
    assert signals.refused[:1] == [taken] and signals.cancelled == [cancelled]


async def test_a_renewal_skips_a_row_another_transaction_holds_instead_of_waiting_for_it(api: Services):
    run_id, epoch = await queued_run(api)
    other_id, other_epoch = await queued_run(api)
    signals = Signals()
    keeper = signals.keeper(dsn_of(api))
    lease = Lease(run_id, epoch, expires_at=time.monotonic() + LEASE_S)
    other = Lease(other_id, other_epoch, expires_at=time.monotonic() + LEASE_S)
    keeper.start()
    try:
        signals.hold(keeper, lease)
        signals.hold(keeper, other)
        async with api.sessionmaker() as session, session.begin():
            await session.execute(select(Run).where(Run.id == uuid.UUID(run_id)).with_for_update())
            held_from = time.monotonic()
            await asyncio.sleep(INTERVAL_S * 5)
            other_renewed_to = other.expires_at
        await asyncio.sleep(INTERVAL_S * 3)
    finally:
        await keeper.close()
    assert other_renewed_to > held_from + LEASE_S - 0.5   # renewed while the first row was locked
    assert signals.refused == [] and signals.failures == 0
    assert lease.expires_at > held_from + INTERVAL_S * 5   # and the locked one once it was free


async def test_a_database_outage_shorter_than_the_lease_interrupts_no_lease(api: Services):
    proxy, proxied_dsn = await TcpProxy.before_database(dsn_of(api))
    run_id, epoch = await queued_run(api)
    signals = Signals()
    keeper = signals.keeper(proxied_dsn)
    lease = Lease(run_id, epoch, expires_at=time.monotonic() + LEASE_S)
    keeper.start()
    lapsed = []
    try:
        signals.hold(keeper, lease)
        await asyncio.sleep(INTERVAL_S * 3)
        outage = asyncio.create_task(proxy.cut(0.9))
        while not outage.done():
            lapsed.append(not lease.valid(time.monotonic()))
            await asyncio.sleep(0.05)
        await asyncio.sleep(INTERVAL_S * 5)
        left = await lease_left_s(api, run_id)
    finally:
        await keeper.close()
        await proxy.close()
    assert proxy.cuts == 1 and signals.failures >= 1      # the outage was felt ...
    assert not any(lapsed) and lease.valid(time.monotonic())   # ... and interrupted nothing
    assert signals.refused == [] and left > LEASE_S - 0.6
    assert max(signals.lags) >= 0.9 - INTERVAL_S          # the lag metric saw it


async def test_a_keeper_whose_event_loop_is_wedged_stops_renewing(api: Services):
    run_id, epoch = await queued_run(api)
    signals = Signals()
    keeper = signals.keeper(dsn_of(api))
    lease = Lease(run_id, epoch, expires_at=time.monotonic() + LEASE_S)
    keeper.start()
    try:
        signals.hold(keeper, lease)
        await asyncio.sleep(INTERVAL_S * 2)
        time.sleep(LEASE_S * (WEDGED_LEASES + 1) + 0.5)  # noqa: ASYNC251 (the point: a wedged loop)
        left = await lease_left_s(api, run_id)
    finally:
        await keeper.close()
    assert left < 0                            # its lease lapsed in the ledger: a reaper may act
    assert RunStatus.QUEUED.value == (await api_run(api, run_id)).status


async def test_a_fresh_claim_waits_for_the_next_renewal_and_a_slow_one_is_renewed_at_once(api: Services):
    """No renewal statement per claim: a lease held with nearly all of it left is renewed with the
    keeper's next regular pass; one whose claim ate into it (more than an interval) at once."""
    (fresh_id, fresh_epoch), (slow_id, slow_epoch) = [await queued_run(api) for _ in range(2)]
    lease_s, interval_s = 10.0, 2.0        # the keeper's first regular pass: 2 s after it starts
    keeper = LeaseKeeper(dsn_of(api), lease_s, interval_s)
    renewals: list[float] = []
    keeper.on_renewed = renewals.append
    keeper.start()
    try:
        await asyncio.sleep(0.2)
        fresh = Lease(fresh_id, fresh_epoch, expires_at=time.monotonic() + lease_s)
        keeper.hold(fresh, lambda: None, lambda: None)
        await asyncio.sleep(0.8)
        renewed_fresh = len(renewals)
        slow = Lease(slow_id, slow_epoch, expires_at=time.monotonic() + interval_s * 1.5)
        keeper.hold(slow, lambda: None, lambda: None)
        await asyncio.sleep(0.5)
        renewed_slow = len(renewals)
    finally:
        await keeper.close()
    assert (renewed_fresh, renewed_slow) == (0, 1)     # one renewal, for every lease held
    assert slow.expires_at - time.monotonic() > interval_s * 1.5
