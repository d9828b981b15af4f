"""A routing process: claim loop, run drivers, lease keeper, cancel listener, reaper.

Exactly once, with any number of these processes:
- a run is claimed by one transaction (FOR UPDATE SKIP LOCKED, ACCEPTED → QUEUED
  + lease + replica), committed before the replica is contacted, so no two
  processes ever send the same run to a replica;
- a claimed run is never lost: its lease is renewed about every second while its
  driver lives; when renewals stop, any process's reaper ends it INTERRUPTED
  from its last durable event (never re-run: DESIGN.md "Worker loss");
- every driver write is conditioned on still holding the lease (claims.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from eventlog.events import tokens_in
from eventlog.interface import EventLog, LogPosition
from ledger.models import Model, Run, RunStatus
from router.health import HealthBook, HealthOptions
from router.load import LoadTracker
from router.policy import RouteDecision, RouteRequest, RoutingPolicy, explain
from router.registry import ReplicaRegistry
from services import replica_client
from services.notify import ChannelListener
from services.routing.claims import (
    CANCEL_CHANNEL,
    ClaimedRun,
    lock_accepted,
    lock_own_active,
    mark_queued,
    renew_leases,
    take_expired_leases,
    take_unpublished_terminals,
)
from services.routing.driver import TRITON, DriverSettings, ReplicaClient, RunDriver
from services.routing.finish import (
    Ending,
    TerminalRecord,
    publish_terminal,
    settle_and_fix_terminal,
    terminal_record,
)

log = logging.getLogger(__name__)

DETAIL_EXPIRED_BEFORE_START = "deadline passed before a replica took the run"
DETAIL_DRIVER_LOST = "routing worker {owner} stopped renewing its lease; ended from the last durable event"
LOCATE_MARGIN_MS = 5_000     # clock skew allowed between Postgres (queued_at) and the Kafka broker
REAP_BATCH = 8
# Runs claimed per transaction: small batches spread a burst over every routing process
# instead of letting the first poller take it all (the loop claims again at once when full).
CLAIM_BATCH = 8
HEALTH = HealthOptions(failure_threshold=2, open_s=3.0, check_interval_s=1.0, probe_interval_s=1.0)
HEALTH_TICK_S = 0.25
REPLICA_STOP_TIMEOUT_S = 2.0


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

    @classmethod
    def from_config(cls, config: Mapping[str, Any], owner: str) -> WorkerSettings:
        routing = config["routing"]
        return cls(
            owner=owner,
            lease_seconds=float(routing.get("lease_seconds", 5)),
            poll_interval_s=float(routing.get("poll_interval_ms", 50)) / 1000,
            max_runs=int(routing.get("max_runs_per_worker", 64)),
            coalesce_ms=float(config["kafka"].get("coalesce_ms", 5)),
            first_token_timeout_s=float(routing.get("first_token_timeout_s", 30)),
        )

    @property
    def renew_interval_s(self) -> float:
        # Five renewals per lease: a lease lapses only after several missed in a row.
        return max(0.2, self.lease_seconds / 5)

    def driver(self) -> DriverSettings:
        return DriverSettings(owner=self.owner, lease_seconds=self.lease_seconds,
                              coalesce_ms=self.coalesce_ms, first_token_timeout_s=self.first_token_timeout_s,
                              block_size=self.block_size)


@dataclass(frozen=True, slots=True)
class _Routed:
    claim: ClaimedRun
    request: RouteRequest
    decision: RouteDecision


class RoutingWorker:
    def __init__(self, settings: WorkerSettings, sessions: async_sessionmaker[AsyncSession], events: EventLog,
                 policy: RoutingPolicy, registry: ReplicaRegistry, *, dsn: str | None = None,
                 replicas: ReplicaClient = TRITON) -> None:
        self.settings = settings
        self.sessions = sessions
        self.events = events
        self.policy = policy
        self.registry = registry
        self.replicas = replicas
        self._dsn = dsn                 # for LISTEN (fast cancel); renewals poll as the fallback
        self.drivers: dict[str, RunDriver] = {}
        self._tasks: dict[str, asyncio.Task[TerminalRecord | None]] = {}
        self._requests: dict[str, _Routed] = {}
        self.health = HealthBook(HEALTH)
        self.loads = LoadTracker()
        self.health.sync([spec.name for spec in registry.specs()], time.time())
        self._stopping = asyncio.Event()   # set by stop(): claim nothing more
        self._stopped = asyncio.Event()    # drained: every loop ends

    # --- process lifecycle ------------------------------------------------------------------

    async def serve(self, drain_s: float = 10.0) -> None:
        """Run every loop until stop() is called, then drain: no more claims, while runs in
        progress get up to `drain_s` to finish with their leases still renewed. Runs still
        going after that are abandoned to another process's reaper (their leases lapse)."""
        claiming = asyncio.create_task(
            self._every(self.claim_once, self.settings.poll_interval_s, busy_again=True))
        upkeep = [asyncio.create_task(loop) for loop in (
            self._every(self.renew_once, self.settings.renew_interval_s, until=self._stopped),
            self._every(self.reap_once, self.settings.lease_seconds / 2),
            self._every(self.check_health_once, HEALTH_TICK_S, until=self._stopped))]
        # LISTEN for Runs.Cancel's NOTIFY so a cancel reaches its driver in milliseconds;
        # lease renewals poll cancel_requested_at too, should a notification be lost.
        cancels = ChannelListener(self._dsn, CANCEL_CHANNEL, self._cancel_notified) if self._dsn else None
        if cancels is not None:
            cancels.start()
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
            if cancels is not None:
                await cancels.close()

    def stop(self) -> None:
        self._stopping.set()

    async def drain(self, timeout_s: float) -> None:
        """Wait for runs still in progress (serve() already drains; kept for callers that
        call it after serve returns). Runs left after `timeout_s` go to a reaper."""
        pending = list(self._tasks.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        for task in list(self._tasks.values()):
            task.cancel()

    async def _every(self, step: Any, interval_s: float, busy_again: bool = False,
                     until: asyncio.Event | None = None) -> None:
        done = until or self._stopping
        while not done.is_set():
            busy = False
            try:
                busy = bool(await step())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; retrying", getattr(step, "__name__", step))
            if not (busy and busy_again):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), interval_s)

    # --- claim --------------------------------------------------------------------------------

    async def claim_once(self) -> bool:
        """Claim up to the free capacity; True when it filled it (more may be waiting)."""
        free = min(CLAIM_BATCH, self.settings.max_runs - len(self.drivers))
        if free <= 0 or self._stopping.is_set():
            return False
        now = time.time()
        claim_sent_at = time.monotonic()  # the lease it grants runs from after this instant
        routed: list[_Routed] = []
        expired: list[TerminalRecord] = []
        async with self.sessions() as session, session.begin():
            rows = await lock_accepted(session, free)
            if not rows:
                return False
            for run, model in rows:
                if run.deadline_at.timestamp() <= now:
                    record = await settle_and_fix_terminal(
                        session, str(run.id), Ending(RunStatus.EXPIRED, 0, 0, DETAIL_EXPIRED_BEFORE_START),
                        self.settings.owner, self.settings.lease_seconds)
                    if record is not None:
                        expired.append(record)
                    continue
                item = await self._route(session, run, model, now)
                if item is not None:
                    routed.append(item)
                    self.loads.on_sent(item.decision.replica)
        for item in routed:
            self.policy.on_routed(item.request, item.decision, now)
            self._start_driver(item, claim_sent_at)
        for record in expired:
            await publish_terminal(self.events, self.sessions, record)
        # Claim again at once only if the batch was full of runs taken; runs left ACCEPTED for want
        # of a healthy replica must not spin this loop.
        return len(routed) + len(expired) == free

    async def _route(self, session: AsyncSession, run: Run, model: Model, now: float) -> _Routed | None:
        request = RouteRequest(request_id=str(run.id), model_version=run.model_version,
                               token_ids=tuple(run.prompt_token_ids), max_output_tokens=run.max_output_tokens,
                               conversation_id=run.conversation_id)
        views = self.registry.views(model.worker_pool, now, self.health, self.loads)
        decision = self.policy.choose(request, views, now)
        if decision is None:
            return None  # no healthy replica in the pool: the run stays ACCEPTED for a later pass
        queued_at = await mark_queued(session, run.id, decision.replica, self.settings.owner,
                                      self.settings.lease_seconds)
        claim = ClaimedRun(
            run_id=str(run.id), tenant_id=run.tenant_id, model_version=run.model_version,
            worker_pool=model.worker_pool, tokenizer=model.tokenizer, end_id=model.end_id,
            prompt_token_ids=tuple(run.prompt_token_ids), input_tokens=run.input_tokens,
            max_output_tokens=run.max_output_tokens, conversation_id=run.conversation_id,
            deadline_at=run.deadline_at, replica=decision.replica, queued_at=queued_at)
        return _Routed(claim, request, decision)

    def _start_driver(self, item: _Routed, claim_sent_at: float) -> None:
        entry = self.registry.get(item.decision.replica)
        assert entry is not None, f"policy chose {item.decision.replica}, which is not registered"
        settings = dataclasses.replace(self.settings.driver(), block_size=entry.block_size)
        driver = RunDriver(claim=item.claim, address=entry.grpc_address, settings=settings,
                           sessions=self.sessions, events=self.events, replicas=self.replicas,
                           on_replica_lost=self._replica_failed)
        driver.extend_fence(claim_sent_at)
        run_id = item.claim.run_id
        self.drivers[run_id] = driver
        self._requests[run_id] = item
        task = asyncio.create_task(driver.run(), name=f"run-{run_id}")
        self._tasks[run_id] = task
        task.add_done_callback(functools.partial(self._driver_done, run_id))

    def _driver_done(self, run_id: str, task: asyncio.Task[TerminalRecord | None]) -> None:
        self.drivers.pop(run_id, None)
        self._tasks.pop(run_id, None)
        item = self._requests.pop(run_id, None)
        if item is not None:
            self.loads.on_finished(item.decision.replica)
            self.policy.on_finished(item.request, item.decision.replica, time.time())
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("run %s: driver crashed; the reaper will end it", run_id, exc_info=task.exception())
            return
        record = task.result()
        if item is not None and record is not None and record.status is RunStatus.COMPLETED \
                and self.registry.get(item.decision.replica) is not None:
            self.health.record_success(item.decision.replica, time.time())

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
            record = self.health.record_success if ready else self.health.record_failure
            record(name, time.time())
        return False

    def replicas_changed(self) -> None:
        """Call after the registry was edited (Routing API)."""
        self.health.sync([spec.name for spec in self.registry.specs()], time.time())

    # --- leases and cancels -----------------------------------------------------------------

    async def renew_once(self) -> bool:
        drivers = dict(self.drivers)
        if not drivers:
            return False
        sent_at = time.monotonic()
        async with self.sessions() as session, session.begin():
            states = await renew_leases(session, self.settings.owner, self.settings.lease_seconds,
                                        [driver.progress() for driver in drivers.values()])
        held = {state.run_id: state for state in states}
        for run_id, driver in drivers.items():
            state = held.get(run_id)
            if state is None:
                # Either the driver just finished (settled, so no longer active) or a
                # reaper took the run; in both cases it must stop writing.
                if run_id in self.drivers and not self._tasks[run_id].done():
                    driver.revoke_lease()
            else:
                driver.extend_fence(sent_at)
                if state.cancel_requested:
                    driver.request_cancel()
        return False

    def _cancel_notified(self, run_id: str) -> None:
        driver = self.drivers.get(run_id)
        if driver is not None:
            driver.request_cancel()

    # --- reaper -------------------------------------------------------------------------------

    async def reap_once(self) -> bool:
        async with self.sessions() as session, session.begin():
            expired = [_Expired.of(run) for run in await take_expired_leases(
                session, self.settings.owner, self.settings.lease_seconds, REAP_BATCH)]
        for run in expired:
            try:
                await self._end_abandoned(run)
            except Exception:
                log.exception("reaper: could not end run %s; it will be retried after its lease", run.run_id)
        async with self.sessions() as session, session.begin():
            unpublished = [(str(run.id), int(run.terminal_sequence or 0)) for run in
                           await take_unpublished_terminals(session, self.settings.owner,
                                                            self.settings.lease_seconds, REAP_BATCH)]
        for run_id, sequence in unpublished:
            async with self.sessions() as session:
                record = await terminal_record(session, run_id, sequence)
            log.info("reaper: republishing the terminal event of run %s", run_id)
            await publish_terminal(self.events, self.sessions, record)
        return bool(expired or unpublished)

    async def _end_abandoned(self, run: _Expired) -> None:
        log.warning("reaper: run %s lost its driver %s; ending it INTERRUPTED",
                    run.run_id, run.previous_owner)
        entry = self.registry.get(run.replica) if run.replica else None
        if entry is not None:
            # The replica may still be generating for a driver that no longer reads.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.replicas.stop(entry.grpc_address, run.run_id),
                                       REPLICA_STOP_TIMEOUT_S)
        start = run.first
        if start is None and run.queued_at_ms is not None:
            start = await self.events.locate(run.run_id, run.queued_at_ms - LOCATE_MARGIN_MS)
        durable = await self.events.read_durable(run.run_id, start) if start is not None else []
        last = max((event.sequence for event in durable), default=0)
        ending = Ending(RunStatus.INTERRUPTED, last, tokens_in(durable),
                        DETAIL_DRIVER_LOST.format(owner=run.previous_owner),
                        first=start if run.first is None else None)
        async with self.sessions() as session, session.begin():
            if await lock_own_active(session, run.run_id, self.settings.owner) is None:
                return
            record = await settle_and_fix_terminal(session, run.run_id, ending, self.settings.owner,
                                                   self.settings.lease_seconds)
        if record is not None:
            await publish_terminal(self.events, self.sessions, record)

    # --- views for the Routing API ----------------------------------------------------------

    def explain(self, request: RouteRequest, pool: str) -> RouteDecision | None:
        """What the policy would choose now, without disturbing its state."""
        now = time.time()
        return explain(self.policy, request, self.registry.views(pool, now, self.health, self.loads), now)


async def _cancelled(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class _Expired:
    run_id: str
    replica: str | None
    previous_owner: str
    first: LogPosition | None
    queued_at_ms: int | None

    @classmethod
    def of(cls, run: Run) -> _Expired:
        first = None
        if run.event_partition is not None and run.event_first_offset is not None:
            first = LogPosition(run.event_partition, run.event_first_offset)
        return cls(run_id=str(run.id), replica=run.replica, previous_owner=run.lease_owner or "?",
                   first=first,
                   queued_at_ms=int(run.queued_at.timestamp() * 1000) if run.queued_at else None)
