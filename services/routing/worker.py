"""A routing process: one room per job, all on one event loop except the lease keeper.

    claim loop ──claims──▶ RunDriver per run (driver.py; outcome.decide says how an attempt ended)
    lease keeper (leases.py: own thread, loop and connection) ──renews every lease in one UPDATE
    replica monitor ──scrapes, readiness checks, hung-stream judgment (monitor.py)
    reaper ──ends runs whose lease expired by the ledger's clock, behind a fence (events.py)
    cancel listener ──LISTEN for Runs.Cancel

Exactly once, with any number of these processes:
- a run is claimed by one transaction (FOR UPDATE SKIP LOCKED, ACCEPTED → QUEUED
  + lease + replica), committed before the replica is contacted, so no two
  processes ever send the same run to a replica;
- a claimed run is never lost: its lease is renewed about every second while its
  driver lives; when renewals stop, any process's reaper ends it INTERRUPTED
  from its last durable event (never re-run: DESIGN.md "Worker loss");
- every driver write is conditioned on its lease epoch (claims.py), and every event
  it publishes carries it: a reaper that takes a run over publishes a fence first,
  and readers drop the old owner's later events (eventlog/events.py "Fencing").

Replica state comes from three sources, all feeding router/: the metrics endpoint
of each replica, scraped every [routing].scrape_interval_ms (load for the
policy, restarts: the policy forgets a restarted replica's prefixes; a failed
scrape counts against the replica's circuit breaker); Triton readiness checks
on the breaker's schedule; and the runs themselves (a replica lost mid-run
counts as a failure, a completed run as a success).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from sluice.ledger.channels import CANCEL_CHANNEL, RUNS_ACCEPTED_CHANNEL
from sluice.ledger.claims_sql import any_accepted, queue_runs
from sluice.ledger.db import dsn_of
from sluice.ledger.models import RunStatus
from sluice.ledger.pg import HotPool
from sluice.ledger.settlement import NotOwned
from sluice.services import replica_client
from sluice.services.admission_rules import Sampling
from sluice.services.finish import (
    Ending,
    TerminalRecord,
    publish_terminal,
    settle_and_fix_terminal,
    terminal_record,
)
from sluice.services.notify import ChannelListener
from sluice.services.routing.claims import (
    DETAIL_EXPIRED_BEFORE_START,  # noqa: F401  (re-exported: tests name it from here)
    AcceptedRun,
    ClaimedRun,
    TakenRun,
    claims_held,
    expiry_detail,
    lock_accepted,
    lock_kv_budgets,
    take_expired_leases,
    take_unpublished_terminals,
    within_kv_budgets,
)
from sluice.services.routing.driver import (
    TRITON,
    DriverSettings,
    ReplicaClient,
    RunDriver,
    Target,
    Wake,
    call_replica,
)
from sluice.services.routing.early_call import EarlyCall
from sluice.services.routing.leases import Lease, LeaseKeeper
from sluice.services.routing.monitor import JUDGED_FROM_S, MONITOR_TICK_S, StallGuard, hung
from sluice.services.routing.observability import (
    RoutingMetrics,
    claim_attributes,
    outcome_attributes,
    span_attributes,
)
from sluice.services.routing.run_ledger import SqlRunLedger
from sluice.services.routing.scrape import MetricsScraper
from sluice.services.routing.windows import WindowClock
from sluice.services.telemetry import context_of, tracer, tracing
from sluice.services.traffic import LadderMetrics, TrafficSettings
from sluice.services.trust_scope import cache_salt, scope_of
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings
from sluice.eventlog.events import fence_event, tokens_in
from sluice.eventlog.interface import EventLog
from sluice.router.health import HealthBook, HealthOptions
from sluice.router.load import LoadTracker, record_scrape, restarted
from sluice.router.policy import ReplicaView, RouteDecision, RouteRequest, RoutingPolicy, explain
from sluice.router.registry import ReplicaRegistry, ReplicaSpec
from sluice.router.retry import DEFAULT_MAX_ATTEMPTS, retry_candidates
from sluice.traffic.gpu_budget import kv_tokens
from sluice.traffic.ladder import Step
from sluice.traffic.priority import Headroom, PoolLoad, Priority, has_headroom
from sluice.traffic.priority import ReplicaLoad as PoolReplicaLoad

log = logging.getLogger(__name__)

DETAIL_DRIVER_LOST = "routing worker {owner} stopped renewing its lease; ended from the last durable event"
LOCATE_MARGIN_MS = 5_000     # clock skew allowed between Postgres (queued_at) and the Kafka broker
REAP_BATCH = 8
# A worker whose last look found no run waiting, its LISTEN for admission's NOTIFY established, polls
# this often instead of every [routing].poll_interval_ms: only a NOTIFY can bring it a new run, and a
# reconnect of the listener (notifications lost meanwhile) wakes it at once.
IDLE_POLL_S = 1.0
CLAIM_RECHECK_S = 0.2        # after a failed claim, ask the ledger again this soon which runs it holds
# Runs claimed per transaction: small batches spread a burst over every routing process
# instead of letting the first poller take it all (the loop claims again at once when full).
CLAIM_BATCH = 8
# Claim passes in flight at once. A run whose NOTIFY arrives after a pass in flight has sent its lock
# is not in that pass's snapshot: a second pass takes it instead of waiting for the first one's COMMIT
# (four round trips, each a wake-up of this process and of a backend on a loaded box; a burst of 16
# Submits waited ~2 passes for its claim, issue 9). SKIP LOCKED keeps the passes disjoint. Only once
# the passes in flight have gone on SECOND_PASS_AFTER_S: a pass's lock and queue cost nearly the same
# for one run as for eight (bench_ledger_run), and in bench-platform's run-cost phase (16 concurrent)
# lock statements per run were 0.37 one pass at a time, 0.63 with second passes at once, 0.51 so.
MAX_CLAIM_PASSES = 3
SECOND_PASS_AFTER_S = 0.005
HEALTH = HealthOptions(failure_threshold=2, open_s=3.0, check_interval_s=1.0, probe_interval_s=1.0)
HEALTH_TICK_S = 0.25
REPLICA_STOP_TIMEOUT_S = 2.0
SCRAPE_TIMEOUT_S = 1.0      # a metrics endpoint slower than this counts as a failed scrape
IDLE_SCRAPE_S = 1.0         # the scrape interval while this process drives no run (_scrape_interval)


def new_owner_id(label: str | None = None) -> str:
    """Lease owner id: unique per process start, readable in the ledger."""
    return f"{label or socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    owner: str
    lease_seconds: float
    poll_interval_s: float
    max_runs: int
    coalesce_ms: float
    first_token_timeout_s: float
    block_size: int = 16
    scrape_interval_s: float = 0.25     # 0 = replicas are not scraped
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    coalesce_max_tokens: int = 0
    coalesce_aligned: bool = False
    headroom: Headroom = Headroom()     # [traffic]: what a pool must be below for batch dispatch

    @classmethod
    def from_config(cls, config: Settings, owner: str) -> WorkerSettings:
        routing = config.routing
        return cls(
            owner=owner,
            lease_seconds=routing.lease_seconds,
            poll_interval_s=routing.poll_interval_ms / 1000,
            max_runs=routing.max_runs_per_worker,
            coalesce_ms=config.kafka.coalesce_ms,
            first_token_timeout_s=routing.first_token_timeout_s,
            scrape_interval_s=routing.scrape_interval_ms / 1000,
            max_attempts=routing.max_attempts,
            coalesce_max_tokens=config.kafka.coalesce_max_tokens,
            coalesce_aligned=config.kafka.coalesce_aligned,
            headroom=TrafficSettings.from_config(config).headroom,
        )

    @property
    def renew_interval_s(self) -> float:
        # Five renewals per lease: a lease lapses only after several missed in a row.
        return max(0.2, self.lease_seconds / 5)

    def driver(self) -> DriverSettings:
        return DriverSettings(owner=self.owner, lease_seconds=self.lease_seconds,
                              coalesce_ms=self.coalesce_ms, first_token_timeout_s=self.first_token_timeout_s,
                              block_size=self.block_size, max_attempts=self.max_attempts,
                              coalesce_max_tokens=self.coalesce_max_tokens,
                              coalesce_aligned=self.coalesce_aligned)


@dataclass(slots=True)
class _Pass:
    locked: bool = False         # the pass has sent its lock (its snapshot of ACCEPTED runs is taken)
    # Each routed run's replica call, sent at once while the claim is written (early_call.py), until
    # its driver takes it; one left when the pass ends (its claim failed) is cancelled.
    early: dict[str, EarlyCall] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Routed:
    claim: ClaimedRun
    request: RouteRequest
    decision: RouteDecision
    granted_from: float = 0.0    # monotonic: before the claim's transaction began


class RoutingWorker:
    def __init__(self, settings: WorkerSettings, sessions: async_sessionmaker[AsyncSession], events: EventLog,
                 policy: RoutingPolicy, registry: ReplicaRegistry, *, dsn: str | None = None,
                 replicas: ReplicaClient = TRITON, metrics: RoutingMetrics | None = None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.events = events
        self.policy = policy
        self.registry = registry
        self.replicas = replicas
        self._dsn = dsn                 # for LISTEN (fast claim and cancel); polling is the fallback
        # The driver's ledger statements (RUNNING, settlement, terminal published) on raw asyncpg
        # connections (ledger/pg.py); opened on first use, closed when serve() ends.
        # They reach the ledger as the session factory does (a test's proxy sits in front of both).
        # (A worker built without a session factory, to look at its policy, never opens it.)
        self.pool = HotPool(dsn or "" if sessions is None else dsn_of(sessions))
        self.ledger = SqlRunLedger(sessions, events, settings.owner, settings.lease_seconds, self.pool)
        self.keeper = LeaseKeeper(dsn or dsn_of(sessions), settings.lease_seconds, settings.renew_interval_s)
        self._alive_at: dict[str, float] = {}   # replica -> monotonic time it last proved alive
        self.scraper = MetricsScraper()         # one kept-alive connection per metrics endpoint
        self._published_health: dict[str, bool] = {}   # the health gauges as last set
        self.drivers: dict[str, RunDriver] = {}
        self._windows: WindowClock | None = None   # closes every driver's DELTA windows (made on the loop)
        self._tasks: dict[str, asyncio.Task[TerminalRecord | None]] = {}
        self._requests: dict[str, _Routed] = {}
        self.health = HealthBook(HEALTH)
        self.loads = LoadTracker()
        self.metrics = metrics or RoutingMetrics()
        self.ladder = LadderMetrics(self.metrics.registry)
        self.keeper.on_renewed = self.metrics.lease_renewed
        self.keeper.on_failed = self.metrics.lease_renewal_failed
        self.health.sync([spec.name for spec in registry.specs()], time.time())
        self._stopping = asyncio.Event()   # set by stop(): claim nothing more
        # Set by admission's NOTIFY of a new run: one flag, so a burst of notifications while a claim
        # is in flight coalesces into ONE more claim pass, never one pass per notification.
        self._accepted = False
        # The claim loop's one wake-up call: a NOTIFY, a pass that ended, its timer, stop(). (Waiting on
        # each of those with asyncio.wait took two tasks and a future per source at every turn.)
        self._claim_wake = Wake()
        self._claim_timer_fired = False
        # Set with _accepted, and by a full claim pass: the next pass locks at once instead of first
        # asking whether anything waits (a timer's poll asks: most find nothing).
        self._claim_hinted = True
        self._idle = False                 # the last claim pass or poll found no run ACCEPTED
        # Admission's NOTIFYs heard so far, and how many had been heard when the latest claim pass sent
        # its lock: one heard after that is a run that pass may not see (another pass may start).
        self._heard = 0
        self._heard_at_lock = 0
        self._unlocked = 0                 # claim passes begun that have not sent their lock yet
        self._claiming = 0                 # runs the claim passes in flight may take (their `free`)
        self._accepted_listener: ChannelListener | None = None
        self._stopped = asyncio.Event()    # drained: every loop ends
        self._started_at = time.monotonic()
        self._stall_guard = StallGuard(self._started_at)

    # --- process lifecycle ------------------------------------------------------------------

    async def serve(self, drain_s: float = 10.0) -> None:
        """Run every loop until stop() is called, then drain: no more claims, while runs in
        progress get up to `drain_s` to finish with their leases still renewed. Runs still
        going after that are abandoned to another process's reaper (their leases lapse)."""
        claiming = asyncio.create_task(self._claim_loop())
        self.keeper.start()
        upkeep = [asyncio.create_task(loop) for loop in (
            self._every(self.monitor_once, MONITOR_TICK_S, until=self._stopped),
            self._every(self.reap_once, self.settings.lease_seconds / 2),
            self._every(self.check_health_once, HEALTH_TICK_S, until=self._stopped))]
        if self.settings.scrape_interval_s > 0:
            upkeep.append(asyncio.create_task(
                self._every(self.scrape_once, self._scrape_interval, until=self._stopped)))
        # LISTEN for Runs.Cancel's NOTIFY so a cancel reaches its driver in milliseconds, and for
        # admission's NOTIFY of each new run so the claim loop wakes at once instead of at its next
        # poll. Both keep polling (lease renewals read cancel_requested_at; the claim loop its
        # interval), should a notification be lost while a listener reconnects.
        if self._dsn is not None:
            self._accepted_listener = ChannelListener(self._dsn, RUNS_ACCEPTED_CHANNEL, self._run_accepted,
                                                      on_connect=self._listener_connected)
        listeners = [] if self._dsn is None or self._accepted_listener is None else [
            ChannelListener(self._dsn, CANCEL_CHANNEL, self._cancel_notified), self._accepted_listener]
        for listener in listeners:
            listener.start()
        try:
            await self._stopping.wait()
            await _cancelled(claiming)
            pending = list(self._tasks.values())
            if pending:
                await asyncio.wait(pending, timeout=drain_s)
        finally:
            self._stopped.set()
            for task in self._tasks.values():
                task.cancel()
            await _cancelled(claiming, *upkeep)
            self.scraper.close()
            await self.keeper.close()
            for listener in listeners:
                await listener.close()
            await self.ledger.close()      # the terminal-published marks still gathering
            await self.pool.close()

    def stop(self) -> None:
        self._stopping.set()
        self._claim_wake.set()

    async def _every(self, step: Any, interval_s: float | Callable[[], float], busy_again: bool = False,
                     until: asyncio.Event | None = None, wake: asyncio.Event | None = None) -> None:
        """Run `step` every `interval_s` (or what it returns, asked after each step) until `until`
        (default: stop()) is set; at once again when it reports more work (`busy_again`), or when
        `wake` is set (cleared before each step, so every wake-up that arrived during a step is
        answered by exactly one more step)."""
        done = until or self._stopping
        while not done.is_set():
            if wake is not None:
                wake.clear()
            busy = False
            try:
                busy = bool(await step())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; retrying", getattr(step, "__name__", step))
            if busy and busy_again:
                continue
            pause = interval_s() if callable(interval_s) else interval_s
            if wake is None:
                # A plain timer: a loop without a wake-up signal sees `done` at its next tick, and
                # serve() cancels every loop once drained. Waiting on `done` as well took two tasks
                # per tick (the upkeep loops tick several times a second, busy or idle).
                await asyncio.sleep(pause)
            else:
                await _first_of(pause, done, wake)

    # --- claim --------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        """Claim passes until stop(): one at start, on admission's NOTIFY, after a full pass and on the
        poll timer (_claim_interval) while none is in flight. A NOTIFY heard once every pass in flight
        has sent its lock starts another pass if they are still going SECOND_PASS_AFTER_S later (up to
        MAX_CLAIM_PASSES); otherwise a wake-up that arrives while passes run is answered by one more
        pass once they end, as with one pass at a time."""
        passes: set[asyncio.Task[bool]] = set()
        due = True
        unseen_since: float | None = None    # when a NOTIFY no pass in flight will see began to wait
        wake = self._claim_wake
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping.is_set():
                wake.clear()
                now = time.monotonic()
                unseen = due and bool(passes) and len(passes) < MAX_CLAIM_PASSES and self._unlocked == 0 \
                    and self._heard > self._heard_at_lock
                unseen_since = (unseen_since or now) if unseen else None
                if due and (not passes or (unseen_since is not None
                                           and now - unseen_since >= SECOND_PASS_AFTER_S)):
                    due, unseen_since = False, None
                    self._accepted = False
                    claim_pass = asyncio.create_task(self._claim_pass())
                    claim_pass.add_done_callback(lambda _: wake.set())
                    passes.add(claim_pass)
                timeout = self._claim_interval() if not passes else \
                    None if unseen_since is None else unseen_since + SECOND_PASS_AFTER_S - now
                self._claim_timer_fired = False
                timer = None if timeout is None else loop.call_later(max(0.0, timeout), self._claim_timer)
                try:
                    await wake.wait()
                finally:
                    if timer is not None:
                        timer.cancel()
                ended = {task for task in passes if task.done()}
                passes -= ended
                due = due or self._accepted or self._claim_timer_fired or any(task.result() for task in ended)
        finally:
            await _cancelled(*passes)

    def _claim_timer(self) -> None:
        self._claim_timer_fired = True
        self._claim_wake.set()

    def _listener_connected(self) -> None:
        """Admission's listener (re)connected: notifications may have been lost meanwhile."""
        self._accepted = True
        self._claim_wake.set()

    async def _claim_pass(self) -> bool:
        """One claim pass; an error is logged and counts as a pass that found nothing."""
        try:
            return bool(await self.claim_once())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("claim_once failed; retrying")
            return False

    async def claim_once(self) -> bool:
        """Claim up to the free capacity; True when it filled it (more may be waiting).

        One transaction on a hot connection (ledger/claims_sql.py): BEGIN, the runs locked (both
        priority classes in one statement), the tenants' GPU-memory budgets only when one of them
        has one, every run routed in the pass queued in one statement, COMMIT. A timer's poll first
        asks whether any run waits at all (one autocommit SELECT, where an idle worker's polls end);
        a pass woken by admission's NOTIFY, or following a full one, locks at once."""
        hinted, self._claim_hinted = self._claim_hinted, False
        free = min(CLAIM_BATCH, self.settings.max_runs - len(self.drivers) - self._claiming)
        if free <= 0 or self._stopping.is_set():
            return False
        self._claiming += free
        self._unlocked += 1
        claim = _Pass()
        try:
            return await self._claim(claim, free, hinted)
        finally:
            for call in claim.early.values():
                call.cancel()
            self._claiming -= free
            if not claim.locked:
                self._unlocked -= 1

    def _locking(self, claim: _Pass) -> None:
        """`claim` sends its lock now: what admission notified until here is in its snapshot."""
        claim.locked = True
        self._unlocked -= 1
        self._heard_at_lock = self._heard

    async def _claim(self, claim: _Pass, free: int, hinted: bool) -> bool:
        if not hinted:
            # A timer's poll: one autocommit round trip says whether anything waits at all.
            async with self.pool.connection() as connection:
                self._idle = not await any_accepted(connection)
            if self._idle:
                return False
        now = time.time()
        started_ns = time.time_ns()
        # The ledger's lease runs from its transaction's start (now()), after this instant: a deadline
        # counted from here is never later than the ledger's. The keeper renews it within an interval
        # (at once if the claim took long: LeaseKeeper.hold).
        claim_started = time.monotonic()
        # Batch runs only with what interactive runs left of the pass, and only from pools with
        # headroom (ladder step 1, "defer batch", for the others).
        blocked = self._pools_without_headroom(now)
        decided: list[tuple[AcceptedRun, RouteRequest, RouteDecision]] = []
        routed: list[_Routed] = []
        expired: list[TerminalRecord] = []
        claims: dict[uuid.UUID, ClaimedRun] = {}
        try:
            async with self.pool.connection() as connection, connection.transaction():
                self._locking(claim)
                rows = await lock_accepted(connection, free, blocked)
                self._idle = not rows
                self._record_ladder(blocked, interactive_waiting=sum(
                    run.priority == Priority.INTERACTIVE for run in rows) >= free)
                if not rows:
                    return False
                # Started only once there is something to claim: an idle poll every 50 ms is no span.
                span = tracer().start_span("routing.claim", start_time=started_ns, attributes={
                    "sluice.owner": self.settings.owner, "sluice.locked": len(rows)})
                kv = await lock_kv_budgets(connection, rows)
                fits = within_kv_budgets(rows, kv, now)
                for run in rows:
                    if run.deadline_at.timestamp() <= now:
                        detail = expiry_detail(run.priority, run.tenant_id, kv,
                                               kv_tokens(run.input_tokens, run.max_output_tokens),
                                               run.worker_pool in blocked)
                        record = await settle_and_fix_terminal(
                            connection, str(run.id), Ending(RunStatus.EXPIRED, 0, 0, detail),
                            self.settings.owner, self.settings.lease_seconds, run.lease_epoch)
                        if record is not None:
                            expired.append(record)
                        continue
                    if run.id not in fits:
                        continue    # waits ACCEPTED for its tenant's GPU-memory budget
                    if run.priority == Priority.BATCH and not self._has_headroom(run.worker_pool, now):
                        self.ladder.acted(run.worker_pool, Step.DEFER_BATCH)
                        continue    # the runs sent in this pass used the pool's headroom up
                    choice = self._decide(run, now)
                    if choice is not None:
                        decided.append((run, *choice))
                        # Counted at once, so the batch's next decisions see this run's load.
                        self.loads.on_sent(choice[1].replica)
                        claims[run.id] = self._unqueued(run, *choice)
                        claim.early[str(run.id)] = self._call_early(claims[run.id])
                if decided:
                    queued = await queue_runs(connection, {run.id: decision.replica
                                                           for run, _, decision in decided},
                                              self.settings.owner, self.settings.lease_seconds)
                    routed = [self._claimed(claims[run.id], request, decision, queued, claim_started)
                              for run, request, decision in decided]
        except Exception as error:
            # The claim failed, perhaps only its COMMIT's acknowledgment (connection lost after the
            # COMMIT left): the ledger says which runs are leased to us under the epochs granted.
            committed = await self._committed_claims(routed, error) if routed else []
            kept = {item.claim.run_id for item in committed}
            for run, _, decision in decided:
                if str(run.id) not in kept:
                    self.loads.on_finished(decision.replica)
            if not committed:
                raise
            routed, expired = committed, []   # an EXPIRED settlement unconfirmed: its reaper republishes
        except BaseException:
            for _, _, decision in decided:
                self.loads.on_finished(decision.replica)
            raise
        span.set_attributes({"sluice.routed": len(routed), "sluice.expired": len(expired)})
        link = trace.Link(span.get_span_context())
        span.end()
        claimed_ns = time.time_ns()
        traced = tracing()
        for item in routed:
            self.metrics.routed(item.claim.route)
            self.policy.on_routed(item.request, item.decision, now)
            if traced:
                # The claim seen from each run's own trace (the batch span above is the worker's).
                claim_span = tracer().start_span("run.claim", context=context_of(item.claim.traceparent),
                                                 start_time=started_ns, links=[link],
                                                 attributes=claim_attributes(item.claim, item.decision))
                claim_span.end(end_time=claimed_ns)
            self._start_driver(item, link if traced else None, claim.early.pop(item.claim.run_id, None))
        for record in expired:
            await publish_terminal(self.events, self.sessions, record)
        # Claim again at once only if the batch was full of runs taken; runs left ACCEPTED for want
        # of a healthy replica must not spin this loop.
        full = len(routed) + len(expired) == free
        self._claim_hinted = self._claim_hinted or full
        return full

    async def _committed_claims(self, routed: list[_Routed], error: Exception) -> list[_Routed]:
        """The claims of a failed claim transaction that committed nonetheless (its COMMIT reached
        the ledger but the acknowledgment was lost), read back within their lease, so that they are
        driven rather than left to lapse and be reaped as INTERRUPTED runs that never started. The
        ledger is asked until it answers or the lease runs out (then the reaper ends any that did
        commit)."""
        granted = {item.claim.run_id: item.claim.epoch for item in routed}
        until = min(item.granted_from for item in routed) + self.settings.lease_seconds
        while True:
            try:
                sent = time.monotonic()
                async with self.sessions() as session:
                    held = await claims_held(session, granted, self.settings.owner)
                break
            except Exception as again:
                if time.monotonic() + CLAIM_RECHECK_S >= until:
                    log.error("claim of %d runs failed (%r) and could not be confirmed within its lease"
                              " (%r); the reaper ends any that committed", len(routed), error, again)
                    return []
                await asyncio.sleep(CLAIM_RECHECK_S)
        # Each driver's deadline is the ledger's (sent + remaining), as a renewal would set it.
        lease_s = self.settings.lease_seconds
        committed = [dataclasses.replace(item, granted_from=sent + held[item.claim.run_id] - lease_s)
                     for item in routed if item.claim.run_id in held]
        if committed:
            log.warning("claim failed (%r) after its COMMIT landed: driving the %d runs the ledger"
                        " leased to this process", error, len(committed))
        return committed

    def _decide(self, run: AcceptedRun, now: float) -> tuple[RouteRequest, RouteDecision] | None:
        """The policy's replica for `run`; None when no healthy replica serves its pool (the run then
        stays ACCEPTED for a later pass)."""
        salt = cache_salt(run.cache_scope or scope_of(run.tenant_id, None))
        request = RouteRequest(request_id=str(run.id), model_version=run.model_version,
                               token_ids=run.prompt_token_ids, max_output_tokens=run.max_output_tokens,
                               conversation_id=run.conversation_id, cache_salt=salt)
        views = self.registry.views(run.worker_pool, now, self.health, self.loads)
        decision = self._choose(request, views, now)
        return None if decision is None else (request, decision)

    @staticmethod
    def _unqueued(run: AcceptedRun, request: RouteRequest, decision: RouteDecision) -> ClaimedRun:
        """The run as routed, before its claim is written (no queued_at, no epoch yet)."""
        return ClaimedRun(
            run_id=str(run.id), tenant_id=run.tenant_id, model_version=run.model_version,
            worker_pool=run.worker_pool, tokenizer=run.tokenizer, end_id=run.end_id,
            prompt_token_ids=run.prompt_token_ids, input_tokens=run.input_tokens,
            max_output_tokens=run.max_output_tokens, conversation_id=run.conversation_id,
            deadline_at=run.deadline_at, replica=decision.replica, queued_at=None,
            created_at=run.created_at, cache_salt=request.cache_salt,
            sampling=Sampling.from_json(run.sampling), route=run.route, traceparent=run.traceparent)

    @staticmethod
    def _claimed(claim: ClaimedRun, request: RouteRequest, decision: RouteDecision,
                 queued: dict[uuid.UUID, tuple[dt.datetime, int]], claim_started: float) -> _Routed:
        run_id = uuid.UUID(claim.run_id)
        assert run_id in queued, f"run {run_id} was locked as ACCEPTED yet could not be queued"
        queued_at, epoch = queued[run_id]
        return _Routed(dataclasses.replace(claim, queued_at=queued_at, epoch=epoch), request, decision,
                       claim_started)

    def _call_early(self, claim: ClaimedRun) -> EarlyCall:
        """The routed run's replica call, sent before its claim commits (early_call.py)."""
        assert claim.replica is not None
        target = self._target_of(claim.replica)
        return EarlyCall(target.address, lambda take: call_replica(self.replicas, target.address, claim,
                                                                    target.cache_salt_id, take))

    def _has_headroom(self, pool: str, now: float) -> bool:
        """Is the pool below every batch threshold (sluice/traffic/priority.py), as last scraped plus
        the runs this process sent since? A run sent just before a scrape may be in neither count yet
        (in transit to the replica), so this process's own runs in flight bound the running count
        from below."""
        loads = []
        for view in self.registry.views(pool, now, self.health, self.loads):
            snapshot = self.loads.snapshot(view.name)
            running = max(view.running, view.in_flight - view.waiting)
            loads.append(PoolReplicaLoad(waiting=view.waiting, running=running,
                                         kv_used_blocks=view.kv_used_blocks,
                                         kv_capacity_blocks=view.kv_capacity_blocks,
                                         max_slots=snapshot.max_requests if snapshot is not None else 0))
        return has_headroom(PoolLoad.of(loads), self.settings.headroom)

    def _pools_without_headroom(self, now: float) -> list[str]:
        """The registry's pools where batch must wait this pass for want of headroom."""
        # Replicas serving every model (pool "") are judged per run (_has_headroom).
        return [pool for pool in self.registry.pools() if pool and not self._has_headroom(pool, now)]

    def _record_ladder(self, blocked: Collection[str], interactive_waiting: bool) -> None:
        """Each pool's ladder gauge: step 1 where batch waits, for want of headroom or behind
        interactive runs that filled the pass."""
        for pool in self.registry.pools():
            if pool:
                self.ladder.decided(pool, Step.DEFER_BATCH if pool in blocked or interactive_waiting
                                    else Step.NORMAL)

    def _choose(self, request: RouteRequest, views: list[ReplicaView], now: float) -> RouteDecision | None:
        started = time.perf_counter()
        decision = self.policy.choose(request, views, now)
        if decision is not None:
            self.metrics.decided(self.policy.name, decision, time.perf_counter() - started)
        return decision

    def _target(self, spec: ReplicaSpec) -> Target:
        # The block size the replica reports wins over the configured one: reused blocks x block size
        # is what the run is charged at the cached rate.
        return Target(spec.name, spec.grpc_address, self.loads.load(spec.name).block_size or spec.block_size,
                      spec.cache_salt_id)

    def _target_of(self, replica: str) -> Target:
        entry = self.registry.get(replica)
        assert entry is not None, f"policy chose {replica}, which is not registered"
        return self._target(entry)

    def _start_driver(self, item: _Routed, claim_span: trace.Link | None = None,
                      early: EarlyCall | None = None) -> None:
        target = self._target_of(item.decision.replica)
        settings = dataclasses.replace(self.settings.driver(), block_size=target.block_size,
                                       cache_salt_id=target.cache_salt_id)
        run_id = item.claim.run_id
        lease = Lease(run_id, item.claim.epoch, expires_at=item.granted_from + self.settings.lease_seconds)
        if self._windows is None:
            self._windows = WindowClock(asyncio.get_running_loop())
        driver = RunDriver(claim=item.claim, address=target.address, settings=settings, events=self.events,
                           ledger=self.ledger, lease=lease, replicas=self.replicas,
                           on_replica_lost=self._replica_failed, reroute=self._reroute, clock=self._windows,
                           early=early)
        self.keeper.hold(lease, driver.revoke_lease, driver.request_cancel)
        self.drivers[run_id] = driver
        self._requests[run_id] = item
        task = asyncio.create_task(self._drive(item, driver, claim_span), name=f"run-{run_id}")
        self._tasks[run_id] = task
        task.add_done_callback(functools.partial(self._driver_done, run_id, driver))

    async def _drive(self, item: _Routed, driver: RunDriver,
                     claim_span: trace.Link | None) -> TerminalRecord | None:
        if not tracing():
            return await driver.run()        # nothing records spans: none made, no attributes built
        claim = item.claim
        attributes = span_attributes(claim.run_id, claim.model_version, claim.worker_pool, item.decision,
                                     claim.input_tokens)
        with tracer().start_as_current_span("run.drive", context=context_of(claim.traceparent),
                                            attributes=attributes,
                                            links=[claim_span] if claim_span is not None else None) as span:
            record = await driver.run()
            if driver.outcome is not None:
                span.set_attributes(outcome_attributes(driver.outcome))
            else:
                span.set_attribute("sluice.status", "lease_lost")
            return record

    def _driver_done(self, run_id: str, driver: RunDriver, task: asyncio.Task[TerminalRecord | None]) -> None:
        self.keeper.release(run_id)
        self.drivers.pop(run_id, None)
        self._tasks.pop(run_id, None)
        item = self._requests.pop(run_id, None)
        if item is not None:
            self.loads.on_finished(item.decision.replica)
            self.policy.on_finished(item.request, item.decision.replica, time.time(),
                                    output_tokens=driver.output_tokens)
        if driver.outcome is not None:
            predicted = item.decision.predicted_cached_tokens if item is not None else 0
            self.metrics.run_ended(driver.claim.worker_pool, predicted, driver.outcome)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("run %s: driver crashed; the reaper will end it", run_id, exc_info=task.exception())
            return
        record = task.result()
        if item is not None and record is not None and record.status is RunStatus.COMPLETED \
                and self.registry.get(item.decision.replica) is not None:
            self.health.record_success(item.decision.replica, time.time())

    async def _reroute(self, driver: RunDriver) -> Target | None:
        """A driver's attempt failed before the first token: release it and choose among the replicas
        the run has not tried (the driver commits the new replica to the ledger before contacting it)."""
        run_id = driver.run_id
        item = self._requests.pop(run_id, None)
        if item is None:
            return None
        now = time.time()
        self.loads.on_finished(item.decision.replica)
        self.policy.on_finished(item.request, item.decision.replica, now)
        views = retry_candidates(self.registry.views(item.claim.worker_pool, now, self.health, self.loads),
                                 driver.tried)
        decision = self._choose(item.request, views, now)
        if decision is None:
            return None
        entry = self.registry.get(decision.replica)
        assert entry is not None, f"policy chose {decision.replica}, which is not registered"
        self.policy.on_routed(item.request, decision, now)
        self.loads.on_sent(decision.replica)
        self._requests[run_id] = _Routed(dataclasses.replace(item.claim, replica=decision.replica),
                                         item.request, decision, item.granted_from)
        self.metrics.retried(item.claim.worker_pool)
        return self._target(entry)

    def _replica_failed(self, name: str) -> None:
        if self.registry.get(name) is not None:
            self.health.record_failure(name, time.time())

    async def check_health_once(self) -> bool:
        """Active readiness checks of the replicas that are due one (router.health schedules them)."""
        for name in self.health.due_checks(time.time()):
            spec = self.registry.get(name)
            if spec is None:
                self.health.forget(name)
                continue
            ready = await replica_client.is_ready(spec.grpc_address, timeout_s=1.0)
            if ready:
                self._alive_at[name] = time.monotonic()
            record = self.health.record_success if ready else self.health.record_failure
            record(name, time.time())
        now = time.time()
        healthy = {spec.name: self.health.is_healthy(spec.name, now) for spec in self.registry.specs()}
        if healthy != self._published_health:     # the gauges change only with a verdict
            self.metrics.health(healthy)
            self._published_health = healthy
        return False

    def _scrape_interval(self) -> float:
        """The scrape loop's next pause: the configured interval while this process drives a run,
        IDLE_SCRAPE_S otherwise. What an idle process's scrapes feed waits for its next claim (the
        load a policy routes on: the replicas' own runs plus what this process sent since the last
        scrape; restarts), and a scrape costs ~0.1 ms of this process's CPU on its kept connection
        (scrape.py; ~0.5 ms when each was a TCP connection: four a second per replica was most of an
        idle routing process's CPU, issue 9)."""
        if self.drivers:
            return self.settings.scrape_interval_s
        return max(self.settings.scrape_interval_s, IDLE_SCRAPE_S)

    async def scrape_once(self) -> bool:
        """Scrape every replica's metrics endpoint at once (a slow one delays no other)."""
        specs = [spec for spec in self.registry.specs() if spec.metrics_url]
        self.scraper.keep_only({spec.metrics_url for spec in specs})
        if specs:
            await asyncio.gather(*(self._scrape(spec) for spec in specs))
        return False

    async def _scrape(self, spec: ReplicaSpec) -> None:
        started = time.perf_counter()
        try:
            text = await self.scraper.fetch(spec.metrics_url, SCRAPE_TIMEOUT_S)
            previous = self.loads.snapshot(spec.name)
            snapshot = record_scrape(self.loads, self.policy, spec.name, text)
            self._alive_at[spec.name] = time.monotonic()
        except (OSError, TimeoutError, ValueError) as exc:   # ScrapeError is a ValueError
            self.metrics.scrape_failed(spec.name, time.perf_counter() - started)
            if self.registry.get(spec.name) is not None:   # not removed while we waited
                self.health.record_failure(spec.name, time.time())
            log.debug("scrape of %s (%s) failed: %r", spec.name, spec.metrics_url, exc)
            return
        was_restarted = restarted(previous, snapshot)
        if was_restarted:
            log.info("replica %s restarted (start time %s -> %s): its cached prefixes are forgotten",
                     spec.name, previous.start_time if previous else None, snapshot.start_time)
        self.metrics.scraped(spec.name, snapshot, time.perf_counter() - started, was_restarted)

    def replicas_changed(self) -> None:
        """Call after the registry was edited (Routing API)."""
        names = {spec.name for spec in self.registry.specs()}
        for gone in {name for name in self.loads.loads() if name not in names}:
            self.loads.forget(gone)
            self.metrics.forget_replica(gone)
        self.health.sync(sorted(names), time.time())

    # --- leases and cancels -----------------------------------------------------------------

    async def monitor_once(self) -> bool:
        """The replica monitor's judgment of every stream in progress (monitor.py): a replica silent
        past its step time whose liveness lapsed is hung, and the runs on it end INTERRUPTED."""
        now = time.monotonic()
        if not self._stall_guard.may_judge(now):
            log.info("replica monitor: this process stalled; judging no stream until it has read its sockets")
            return False
        scraped: set[str] | None = None
        for driver in list(self.drivers.values()):
            silent_s = driver.silent_for(now)
            if silent_s is None or silent_s < JUDGED_FROM_S:
                continue                       # streaming, or not silent long enough to be hung
            if scraped is None:
                scraped = {spec.name for spec in self.registry.specs() if spec.metrics_url} \
                    if self.settings.scrape_interval_s > 0 else set()
            replica = driver.replica
            alive = self._alive_at.get(replica)
            if replica not in scraped and alive is None:
                age = None
            else:
                age = now - (alive if alive is not None else self._started_at)
            silence = driver.silence(now, age)
            if silence is None:
                continue
            why = hung(silence)
            if why is not None:
                log.warning("run %s: replica %s looks hung (%s); ending the run", driver.run_id, replica, why)
                driver.replica_hung(why)
        return False

    def _claim_interval(self) -> float:
        """The claim loop's next timer poll: every poll interval, or IDLE_POLL_S while nothing waits
        and admission's NOTIFY is heard."""
        listener = self._accepted_listener
        if self._idle and listener is not None and listener.listening:
            return max(self.settings.poll_interval_s, IDLE_POLL_S)
        return self.settings.poll_interval_s

    def _run_accepted(self, pool: str) -> None:
        # A run for a pool none of our replicas serves would stay ACCEPTED here: no reason to wake.
        if self.registry.members(pool):
            self._heard += 1
            self._claim_hinted = True
            self._accepted = True
            self._claim_wake.set()

    def _cancel_notified(self, run_id: str) -> None:
        driver = self.drivers.get(run_id)
        if driver is not None:
            driver.request_cancel()

    # --- reaper -------------------------------------------------------------------------------

    async def reap_once(self) -> bool:
        # Each take is one statement, atomic on its own: autocommit on a hot connection.
        async with self.pool.connection() as connection:
            expired = await take_expired_leases(connection, self.settings.owner, self.settings.lease_seconds,
                                                REAP_BATCH)
        for run in expired:
            try:
                await self._end_abandoned(run)
            except Exception:
                log.exception("reaper: could not end run %s; it will be retried after its lease", run.run_id)
        async with self.pool.connection() as connection:
            unpublished = await take_unpublished_terminals(connection, self.settings.owner,
                                                           self.settings.lease_seconds, REAP_BATCH)
        for run in unpublished:
            async with self.sessions() as session:
                record = await terminal_record(session, run.run_id, int(run.terminal_sequence or 0),
                                               run.epoch)
            log.info("reaper: republishing the terminal event of run %s", run.run_id)
            await publish_terminal(self.events, self.sessions, record)
        return bool(expired or unpublished)

    async def _end_abandoned(self, run: TakenRun) -> None:
        log.warning("reaper: run %s lost its driver %s; ending it INTERRUPTED",
                    run.run_id, run.previous_owner)
        entry = self.registry.get(run.replica) if run.replica else None
        if entry is not None:
            # The replica may still be generating for a driver that no longer reads.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.replicas.stop(entry.grpc_address, run.run_id),
                                       REPLICA_STOP_TIMEOUT_S)
        # The fence first: whatever the old owner still publishes lands after it and is refused by
        # every reader; what it published before is read back below and counted.
        fence = await self.events.append(fence_event(run.run_id, run.epoch, int(time.time() * 1000)))
        start = run.first
        if start is None and run.queued_at is not None:
            queued_ms = int(run.queued_at.timestamp() * 1000)
            start = await self.events.locate(run.run_id, queued_ms - LOCATE_MARGIN_MS)
        durable = await self.events.read_durable(run.run_id, start or fence)
        last = max((event.sequence for event in durable), default=0)
        ending = Ending(RunStatus.INTERRUPTED, last, tokens_in(durable),
                        DETAIL_DRIVER_LOST.format(owner=run.previous_owner),
                        first=(start or fence) if run.first is None else None)
        try:
            async with self.sessions() as session, session.begin():
                record = await settle_and_fix_terminal(session, run.run_id, ending, self.settings.owner,
                                                       self.settings.lease_seconds, run.epoch, owned=True)
        except NotOwned:
            return
        if record is not None:
            await publish_terminal(self.events, self.sessions, record)

    # --- views for the Routing API ----------------------------------------------------------

    def explain(self, request: RouteRequest, pool: str) -> RouteDecision | None:
        """What the policy would choose now, without disturbing its state."""
        now = time.time()
        return explain(self.policy, request, self.registry.views(pool, now, self.health, self.loads), now)


async def _first_of(timeout_s: float, *events: asyncio.Event | None) -> None:
    """Wait until any of `events` is set, or `timeout_s` passes."""
    waits = [asyncio.ensure_future(event.wait()) for event in events if event is not None]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def _cancelled(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

