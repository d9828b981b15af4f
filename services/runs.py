"""Runs service: GetRun, Stream(run_id, after), Cancel. Stateless: any instance serves any run.

A run is visible only to the tenant whose key created it: every method looks
the run up by (tenant, id), so another tenant's run and a run that does not
exist give the same NOT_FOUND.

Stream never reads tokens from the ledger: it reads the event log from where
the run's events start (recorded in the ledger by whoever published the first
event), drops sequences <= after, and follows the log to the terminal event.
A run with no recorded start yet is watched on the process's live tail at once:
when its first event (sequence 1) arrives there, the stream goes on without the
ledger. Otherwise (it began before the stream looked) the stream waits for the
start: woken by the NOTIFY that commits with the run's RUNNING transition (or
its terminal event), and by the listener (re)connecting, when notifications may
have been lost; a slow re-poll of the ledger is the last safety net. The
lookups are single statements on raw asyncpg connections (ledger/runs_sql.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc.aio
from sluice.ledger.channels import CANCEL_CHANNEL, EVENTS_CHANNEL
from sluice.ledger.db import dsn_of
from sluice.ledger.models import TERMINAL_STATUSES, KeyScope, RunStatus
from sluice.ledger.pg import HotPool
from sluice.ledger.run_calls_sql import CallerRun, get_run_view, request_cancel, run_status
from sluice.ledger.runs_sql import EventStart, StreamLookup, event_start, stream_lookup
from sluice.services.admitted_here import RecentAdmissions
from sluice.services.auth import Metadata, api_key_from_metadata, require_scope_of
from sluice.services.errors import (
    UNKNOWN_API_KEY,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Unauthenticated,
    Unavailable,
    grpc_errors,
)
from sluice.services.finish import Ending, TerminalRecord, publish_terminal, settle_and_fix_terminal
from sluice.services.notify import ChannelListener
from sluice.services.routes import route_message
from sluice.services.telemetry import context_of, tracer
from sluice.services.traffic import priority_to_proto
from sluice.services.validation import FieldLimits, add_checked_service
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings
from sluice.eventlog.events import status_value
from sluice.eventlog.interface import (
    CursorPastRetention,
    EventLog,
    LogPosition,
    LogUnavailable,
    ReaderTooSlow,
)
from sluice.v1 import common_pb2, runs_pb2, runs_pb2_grpc

RUN_NOT_FOUND = "run {run_id!r} not found: check the run id (runs are visible to their own tenant only)"
EVENT_LOG_RETRY_AFTER_MS = 500   # a fresh live tail starts with the next Stream: well under a second
EVENT_LOG_UNAVAILABLE_REASON = "EVENT_LOG_UNAVAILABLE"
NEGATIVE_CURSOR = "after must be 0 (from the start) or the last sequence received (got {after})"
DETAIL_CANCELLED_BEFORE_START = "cancelled by the caller before a replica took the run"

# While a run has no events yet, re-read the ledger at least this often. Only a safety net: the
# NOTIFY wakes the stream, and so does the listener reconnecting (when notifications can be lost);
# polling faster would cost one query per waiting stream per interval (256 waiting streams at
# 0.5 s were ~500 queries/s of gateway and PostgreSQL CPU in bench-platform).
WAIT_REPOLL_S = 5.0
# After the NOTIFY that a waiting run's start is recorded, how long a stream opened right after
# Submit leaves its live tail to hand over the run's first event before reading the ledger: the
# NOTIFY often arrives first (the tail takes batches TAIL_BATCH_INTERVAL_MS apart). Only a stream
# whose run's first event went by before it subscribed (rare) waits this much longer.
START_NOTIFIED_GRACE_S = 0.1
# A stream of a run this process admitted a moment before skips the ledger lookup
# (services/admitted_here.py), so its waiter for the start's NOTIFY was registered only after Submit
# returned: a client slow to open it may have let the NOTIFY go by. Unless the run's first event
# reaches it live first, it reads the ledger after this long (instead of WAIT_REPOLL_S).
ADMITTED_HERE_WAIT_S = 0.5
# A stream handed its run's first event (STATUS RUNNING) live waits for the ledger's RUNNING commit
# before passing it on (DESIGN.md: a transition is durable in PostgreSQL before anyone is told of it).
# The commit's NOTIFY usually arrives about when the event does; if it has not within this long (its
# NOTIFY went by before the stream's waiter was registered, or the worker is slow to write), the
# ledger is read instead.
RUNNING_NOTIFIED_WITHIN_S = 0.25
# The routing worker commits RUNNING (with its NOTIFY) while the run's first events travel to the log
# and records where they start a moment later, without a NOTIFY (ledger/runs_sql.py). A stream that
# needs that start (its run's first event went by before it subscribed) and finds the run RUNNING
# without it re-reads the ledger after this long, then twice as long each time, up to WAIT_REPOLL_S
# (_start_polls); so does a stream held for RUNNING whose NOTIFY did not come (_running_recorded).
START_POLL_S = 0.02
# Run ids notified on EVENTS_CHANNEL that the gateway remembers. Every payload there says the run is
# RUNNING or past it in the ledger, a fact that stays true; a stream of a run admitted here registers
# its waiter only once its client opens it, and with a replica that answers within milliseconds the
# RUNNING NOTIFY often came first: the stream then waited out RUNNING_NOTIFIED_WITHIN_S (or
# ADMITTED_HERE_WAIT_S) for it (bench_platform --wire-replicas, 16 concurrent: TTFT added p95 +275 ms).
# At seed 002's 100 runs/s this reaches back ~40 s, where the race spans milliseconds.
NOTIFIED_REMEMBERED = 8192


def _start_polls() -> Iterator[float]:
    """How long each wait for a run's start lasts before the ledger is read again: START_POLL_S,
    then twice as long each time, up to WAIT_REPOLL_S."""
    poll_s = START_POLL_S
    while True:
        yield poll_s
        poll_s = min(2 * poll_s, WAIT_REPOLL_S)


async def _recorded() -> None:
    """first_recorded of a stream whose lookup found RUNNING committed already."""


def _run_uuid(run_id: str) -> uuid.UUID | None:
    """The run id as a UUID; None for one that cannot name a run (NOT_FOUND, but only once the key
    is authenticated: a bad key is UNAUTHENTICATED whatever the id)."""
    try:
        return uuid.UUID(run_id)
    except ValueError:
        return None


def _check_caller(authenticated: bool, scope: KeyScope) -> None:
    """A known key (UNAUTHENTICATED otherwise) of the tenant scope (PERMISSION_DENIED otherwise)."""
    if not authenticated:
        raise Unauthenticated(UNKNOWN_API_KEY)
    require_scope_of(scope, "this tenant API", KeyScope.TENANT)


def _ms(value: Any) -> int:
    return int(value.timestamp() * 1000) if value is not None else 0


@dataclass(frozen=True, slots=True)
class StreamStart:
    """Where a Stream begins reading, or that there is nothing left to send."""

    position: LogPosition | None   # None: nothing to read (the cursor is at/after the terminal event)


def _stream_start(recorded: EventStart, after: int) -> StreamStart | None:
    """Where a Stream after `after` begins, from the run's ledger columns; None: not known yet."""
    if recorded.terminal_sequence is not None and after >= recorded.terminal_sequence:
        return StreamStart(None)
    if recorded.partition is not None and recorded.first_offset is not None:
        return StreamStart(LogPosition(recorded.partition, recorded.first_offset))
    return None


class RunsService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], events: EventLog,
                 lease_seconds: float, dsn: str | None = None, owner: str | None = None,
                 hot: HotPool | None = None, admitted: RecentAdmissions | None = None) -> None:
        self.sessions = sessions
        # New runs this process's Admission admitted, whose first Stream needs no lookup.
        self._admitted = admitted
        # The lookups on raw asyncpg connections (ledger/runs_sql.py): the gateway process's pool
        # when given (its owner closes it), else our own, opened on first use.
        self._owns_hot = hot is None
        self._hot = hot or HotPool(dsn_of(sessions))
        self.events = events
        self.lease_seconds = lease_seconds
        self.owner = owner or f"runs:{os.getpid()}"
        self._started = ChannelListener(dsn, EVENTS_CHANNEL, remember=NOTIFIED_REMEMBERED) if dsn else None

    async def close(self) -> None:
        if self._started is not None:
            await self._started.close()
        if self._owns_hot:
            await self._hot.close()

    async def _caller_run(self, metadata: Metadata, run_id: str) -> tuple[uuid.UUID, CallerRun]:
        """The caller's run (GetRun, Cancel): the key authenticated and tenant-scoped, the run its
        tenant's, one statement (ledger/run_calls_sql.py); raises as the caller must answer."""
        key = api_key_from_metadata(metadata)
        parsed = _run_uuid(run_id)
        async with self._hot.connection() as connection:
            found = await get_run_view(connection, key, parsed)
        _check_caller(found.authenticated, found.scope)
        if found.run is None or parsed is None:
            raise NotFound(RUN_NOT_FOUND.format(run_id=run_id))
        return parsed, found

    # --- GetRun -------------------------------------------------------------------------------

    async def get_run(self, metadata: Metadata, run_id: str) -> runs_pb2.Run:
        _, found = await self._caller_run(metadata, run_id)
        run = found.run
        assert run is not None
        usage = run.usage
        return runs_pb2.Run(
            run_id=str(run.run_id), request_key=run.request_key, model_version=run.model_version,
            status=status_value(run.status.value), replica=run.replica or "", input_tokens=run.input_tokens,
            max_output_tokens=run.max_output_tokens,
            usage=common_pb2.TokenUsage(input_tokens=usage.input_tokens,
                                        cached_input_tokens=usage.cached_input_tokens,
                                        output_tokens=usage.output_tokens, cost_micros=usage.cost_micros),
            created_at_ms=_ms(run.created_at), started_at_ms=_ms(run.started_at),
            finished_at_ms=_ms(run.finished_at), deadline_at_ms=_ms(run.deadline_at),
            last_sequence=run.cursor, detail=run.detail or "", cached_input_tokens=run.cached_input_tokens,
            route=route_message(run.route), priority=priority_to_proto(run.priority))

    # --- Stream -------------------------------------------------------------------------------

    async def stream(self, metadata: Metadata, run_id: str, after: int) -> AsyncIterator[runs_pb2.RunEvent]:
        if after < 0:
            raise InvalidArgument(NEGATIVE_CURSOR.format(after=after))
        key = api_key_from_metadata(metadata)
        parsed = _run_uuid(run_id)
        with contextlib.ExitStack() as waiting:
            # Registered before the lookup: if the lookup finds no start yet, the NOTIFY that records it
            # can only come after this, so the stream waits for it instead of reading the ledger again.
            started = waiting.enter_context(self._started.waiter(str(parsed))) \
                if self._started is not None and parsed is not None else None
            admitted = self._admitted.take(parsed, key) \
                if self._admitted is not None and parsed is not None else None
            if admitted is not None:
                # Submitted through this process a moment ago with this very key: what the lookup would
                # find (the key good and tenant-scoped, the run its tenant's, no events recorded yet).
                found = StreamLookup(True, parsed, EventStart(None, None, None), admitted.traceparent)
            else:
                async with self._hot.connection() as connection:
                    found = await stream_lookup(connection, key, parsed)
            _check_caller(found.authenticated, found.scope)
            if found.run_id is None:
                raise NotFound(RUN_NOT_FOUND.format(run_id=run_id))
            if _stream_start(found.start, after) is not None:
                waiting.close()          # the start is known: nothing to wait for
                started = None
            # One span per Stream call, whichever door (a resumed stream is another span, with its own
            # `after`), in the run's own trace. Not made the current span: a client that goes away closes
            # this generator outside its context.
            span = tracer().start_span("runs.stream", context=context_of(found.traceparent),
                                       attributes={"sluice.run_id": run_id, "sluice.after": after})
            sent = last = 0
            try:
                async for event in self._events_of(found, after, started,
                                                   ADMITTED_HERE_WAIT_S if admitted else WAIT_REPOLL_S):
                    sent, last = sent + 1, event.sequence
                    yield event
            finally:
                span.set_attributes({"sluice.events": sent, "sluice.last_sequence": last})
                span.end()

    async def _events_of(self, found: StreamLookup, after: int, started: asyncio.Event | None,
                         notified_within_s: float) -> AsyncIterator[runs_pb2.RunEvent]:
        # The row just read usually has the start already (a resume, a finished run): no second read.
        known = found.run_id
        assert known is not None
        start = _stream_start(found.start, after)
        if start is None:
            # No events recorded yet (a stream opened right after Submit): the run's first event
            # goes out as soon as the log has it, without waiting for the ledger to say where it is.
            # A run found RUNNING already was notified before this stream looked: no NOTIFY to wait for.
            waiter = None if found.start.started else started
            events = self.events.follow_from_first(
                str(known), after, lambda: self._recorded_position(known, after, waiter, notified_within_s),
                _recorded if found.start.started else lambda: self._running_recorded(known, waiter))
        elif start.position is None:
            return                       # the cursor is at or past the terminal event
        else:
            events = self.events.follow(str(known), start.position, after)
        try:
            async for event in events:
                yield event
        except CursorPastRetention as exc:
            raise OutOfRange(str(exc)) from exc
        except ReaderTooSlow as exc:
            # UNAVAILABLE: the SDK resumes by itself from the last event it received.
            raise Unavailable(str(exc)) from exc
        except LogUnavailable as exc:
            # Transient (the next Stream starts a fresh tail): retry info, so any client resumes.
            raise Unavailable(str(exc), retry_after_ms=EVENT_LOG_RETRY_AFTER_MS,
                              reason=EVENT_LOG_UNAVAILABLE_REASON) from exc

    async def _recorded_position(self, run_id: uuid.UUID, after: int, started: asyncio.Event | None,
                                 notified_within_s: float) -> LogPosition | None:
        return (await self._wait_for_events(run_id, after, started, notified_within_s)).position

    async def _running_recorded(self, run_id: uuid.UUID, started: asyncio.Event | None) -> None:
        """Returns once the ledger has committed the run's RUNNING (or its end). Only RUNNING: where its
        events start is recorded after, in a write nobody is notified of, and a stream that waited for
        that held the first event for up to ~0.6 s at 16 concurrent runs on a loaded box."""
        if self._notified(run_id):
            return
        if started is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RUNNING_NOTIFIED_WITHIN_S):
                    await started.wait()
            if started.is_set():
                return
        for poll_s in _start_polls():
            recorded = await self._event_start(run_id)
            if recorded.started or recorded.terminal_sequence is not None:
                return
            await asyncio.sleep(poll_s)

    async def _wait_for_events(self, run_id: uuid.UUID, after: int,
                               started_since_read: asyncio.Event | None = None,
                               notified_within_s: float = WAIT_REPOLL_S) -> StreamStart:
        """Wait until the run's events have a recorded start in the log (or nothing is left).
        `started_since_read`: a waiter registered before the caller's own read of the ledger found no
        start (or, for a run admitted here, right after its Submit); the ledger is read again only once
        it is woken (or after `notified_within_s`): a stream opened right after Submit is usually handed
        its run's first event live and never reads it at all."""
        if started_since_read is not None:
            if not self._notified(run_id):
                # asyncio.timeout, not wait_for: no task of its own per waiting stream (3.11's wait_for
                # makes one)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(notified_within_s):
                        await started_since_read.wait()
            # The NOTIFY says the first event is durable or about to be (RUNNING commits while it
            # travels); the live tail, hurried, hands it over as soon as the log has it, and then this
            # wait is cancelled without reading the ledger at all.
            if started_since_read.is_set() or self._notified(run_id):
                self.events.hurry()
            await asyncio.sleep(START_NOTIFIED_GRACE_S)
        polls = _start_polls()
        while True:
            poll_s = next(polls)
            if self._started is None:
                recorded = await self._event_start(run_id)
                if (start := _stream_start(recorded, after)) is not None:
                    return start
                await asyncio.sleep(poll_s if recorded.started else WAIT_REPOLL_S / 10)
                continue
            # Register before reading, so a NOTIFY committed in between is not missed.
            with self._started.waiter(str(run_id)) as started:
                recorded = await self._event_start(run_id)
                if (start := _stream_start(recorded, after)) is not None:
                    return start
                # RUNNING recorded without its start: that write follows with no NOTIFY of its own.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_s if recorded.started else WAIT_REPOLL_S):
                        await started.wait()

    def _notified(self, run_id: uuid.UUID) -> bool:
        """The run's RUNNING (or its end) was notified here already (NOTIFIED_REMEMBERED)."""
        return self._started is not None and self._started.heard(str(run_id))

    async def _event_start(self, run_id: uuid.UUID) -> EventStart:
        async with self._hot.connection() as connection:
            return await event_start(connection, run_id)

    # --- Cancel -------------------------------------------------------------------------------

    async def cancel(self, metadata: Metadata, run_id: str) -> runs_pb2.CancelResponse:
        """Cancel's common case, a run in progress, is one statement after the caller's lookup: the
        request recorded with its NOTIFY to the driving worker. A run still ACCEPTED (no worker holds
        it) ends here, settled CANCELLED in a transaction that locks it first: claiming locks the row
        too, so it is either ours to end or the worker's to stop. Statuses only move forward, so a
        run that moved between two looks is looked at again and the loop ends."""
        parsed, found = await self._caller_run(metadata, run_id)
        assert found.status is not None
        status, requested = found.status, found.cancel_requested
        record: TerminalRecord | None = None
        while status not in TERMINAL_STATUSES and not (requested and status is not RunStatus.ACCEPTED):
            async with self._hot.connection() as connection:
                if status is RunStatus.ACCEPTED:
                    async with connection.transaction():
                        status, requested = await run_status(connection, parsed, lock=True)
                        if status is RunStatus.ACCEPTED:
                            record = await settle_and_fix_terminal(
                                connection, str(parsed),
                                Ending(RunStatus.CANCELLED, 0, 0, DETAIL_CANCELLED_BEFORE_START),
                                self.owner, self.lease_seconds)
                            status = RunStatus.CANCELLED
                    continue
                # Delivered on commit to the driving worker's LISTEN; its lease renewal polls too.
                recorded = await request_cancel(connection, parsed, CANCEL_CHANNEL)
                if recorded is not None:
                    status = recorded
                    break
                status, requested = await run_status(connection, parsed)
        if record is not None:
            await publish_terminal(self.events, self.sessions, record, self._hot)
        return runs_pb2.CancelResponse(run_id=run_id, status=status_value(status.value))


class RunsServicer(runs_pb2_grpc.RunsServicer):
    def __init__(self, service: RunsService) -> None:
        self._service = service

    @grpc_errors
    async def GetRun(self, request: runs_pb2.GetRunRequest,
                     context: grpc.aio.ServicerContext) -> runs_pb2.Run:
        return await self._service.get_run(context.invocation_metadata(), request.run_id)

    @grpc_errors
    async def Stream(self, request: runs_pb2.StreamRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[runs_pb2.RunEvent]:
        async for event in self._service.stream(context.invocation_metadata(), request.run_id, request.after):
            yield event

    @grpc_errors
    async def Cancel(self, request: runs_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> runs_pb2.CancelResponse:
        attributes = {"sluice.run_id": request.run_id}
        with tracer().start_as_current_span("runs.cancel", attributes=attributes) as span:
            response = await self._service.cancel(context.invocation_metadata(), request.run_id)
            span.set_attribute("sluice.status", common_pb2.RunStatus.Name(response.status))
            return response


def add_runs_servicer(server: grpc.aio.Server, sessionmaker: async_sessionmaker[AsyncSession],
                      config: Settings, events: EventLog, hot: HotPool | None = None,
                      admitted: RecentAdmissions | None = None) -> RunsService:
    """Register Runs on `server`. `events` is the process's event log (e.g. KafkaEventLog.from_config,
    started and closed by the caller on the server's event loop); `hot` its pool of raw connections
    (ledger/pg.py), shared with Admission (None: the service opens its own); `admitted`: the runs
    Admission admitted here (services/admitted_here.py), whose first Stream skips the lookup."""
    service = RunsService(sessionmaker, events, config.routing.lease_seconds, dsn=config.database.url,
                          hot=hot, admitted=admitted)
    add_checked_service(server, runs_pb2.DESCRIPTOR.services_by_name["Runs"], RunsServicer(service),
                        FieldLimits.from_config(config))
    return service
