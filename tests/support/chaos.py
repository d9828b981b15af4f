"""Sluice's own fault suite: load on the real stack, a fault, then the ledger invariants.

A scenario submits runs through the gateway and streams each (the SDK resumes a broken stream by
itself), injects its fault while they run, waits until every run is terminal and its terminal
event published, then checks what must hold whatever happened:

    settled once      every terminal run has exactly one usage entry; no run in flight has one
    reservations      each tenant's budget.reserved equals the sum reserved by its runs in flight
    events            each run's events in the log are 1, 2, ... n, the last one TERMINAL with the
                      ledger's status and sequence; nothing of the run after it but copies of it
    leases            no QUEUED or RUNNING row whose lease has expired (sampled during the fault
                      window too, where a dead driver's run must be reaped, not left RUNNING)
    streams           every client's stream is contiguous and ends with the ledger's terminal status

Each scenario adds a row to the table `make chaos` prints (pytest_terminal_summary below).
`make test` runs the quick scenarios; SLUICE_CHAOS=1 (make chaos) runs all of them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from sluice.ledger.models import TERMINAL_STATUSES, Budget, Run, RunStatus, UsageEntry
from sluice_client.sdk import SluiceClient, SluiceError
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.events import status_name
from sluice.v1 import admission_pb2, runs_pb2
from tests.support.routing_stack import Stack

FULL = bool(os.environ.get("SLUICE_CHAOS"))
full_only = pytest.mark.skipif(not FULL, reason="part of `make chaos` (SLUICE_CHAOS=1), not make test")

IN_FLIGHT = (RunStatus.QUEUED.value, RunStatus.RUNNING.value)
SUBMIT_ATTEMPTS = 10   # a Submit retried on UNAVAILABLE (Load._submit): a restart lasts well under 2 s


@dataclass(slots=True)
class ChaosResult:
    scenario: str
    runs: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""                      # the figure the scenario is about (e.g. time to INTERRUPTED)
    interrupted_because: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def passed(self) -> bool:
        return not self.violations


RESULTS: list[ChaosResult] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    write = terminalreporter.write_line
    write("")
    write("chaos scenarios (ledger invariants after each fault)")
    header = f"{'scenario':<40} {'runs':>5} {'s':>6}  {'result':<6} statuses / note"
    write(header)
    write("-" * len(header))
    for result in RESULTS:
        statuses = " ".join(f"{name}={count}" for name, count in sorted(result.statuses.items()))
        verdict = "ok" if result.passed else "FAIL"
        write(f"{result.scenario:<40} {result.runs:>5} {result.seconds:>6.1f}  {verdict:<6} {statuses}"
              + (f"; {result.note}" if result.note else ""))
        for violation in result.violations[:5]:
            write(f"    ! {violation}")
        for detail, count in result.interrupted_because.most_common(3):
            write(f"    INTERRUPTED x{count}: {detail}")


# --- invariants -------------------------------------------------------------------------------


async def lease_violations(sessions: async_sessionmaker[AsyncSession]) -> list[str]:
    """QUEUED/RUNNING rows whose lease has lapsed by more than a reaper's pass (2 s of slack)."""
    async with sessions() as session:
        rows = (await session.execute(
            select(Run.id, Run.status, Run.lease_expires_at)
            .where(Run.status.in_(IN_FLIGHT),
                   (Run.lease_expires_at.is_(None))
                   | (Run.lease_expires_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, 2.0))))).all()
    return [f"run {row.id} {row.status} without a live lease (expired {row.lease_expires_at})"
            for row in rows]


async def ledger_violations(sessions: async_sessionmaker[AsyncSession]) -> list[str]:
    found: list[str] = []
    async with sessions() as session:
        runs = (await session.scalars(select(Run))).all()
        entries: dict[uuid.UUID, int] = {row[0]: row[1] for row in (await session.execute(
            select(UsageEntry.run_id, func.count()).group_by(UsageEntry.run_id))).all()}
        reserved: dict[uuid.UUID, int] = {row[0]: int(row[1] or 0) for row in (await session.execute(
            select(Budget.tenant_id, func.sum(Budget.reserved_tokens)).group_by(Budget.tenant_id))).all()}
    in_flight: collections.Counter[uuid.UUID] = collections.Counter()
    for run in runs:
        settled = entries.get(run.id, 0)
        if run.status in TERMINAL_STATUSES and settled != 1:
            found.append(f"run {run.id} {run.status} settled {settled} times")
        if run.status not in TERMINAL_STATUSES:
            if settled:
                found.append(f"run {run.id} {run.status} in flight yet settled")
            in_flight[run.tenant_id] += run.reserved_tokens
    for tenant_id, total in reserved.items():
        if total != in_flight[tenant_id]:
            found.append(f"tenant {tenant_id}: budget reserves {total} tokens,"
                         f" runs in flight {in_flight[tenant_id]}")
    found.extend(await lease_violations(sessions))
    return found


async def log_violations(bootstrap: str, topic: str, runs: Sequence[Run]) -> list[str]:
    """Read each run's events raw (no dedup) from where they start to the partition's end."""
    found: list[str] = []
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        by_partition: dict[int, list[Run]] = collections.defaultdict(list)
        for run in runs:
            if run.event_partition is not None and run.event_first_offset is not None:
                by_partition[run.event_partition].append(run)
        for partition, members in by_partition.items():
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            end = (await consumer.end_offsets([tp]))[tp]
            consumer.seek(tp, min(run.event_first_offset or 0 for run in members))
            wanted = {str(run.id): run for run in members}
            seen: dict[str, list[runs_pb2.RunEvent]] = collections.defaultdict(list)
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=2_000)
                for record in batch.get(tp, []):
                    if record.key is not None and record.key.decode() in wanted:
                        seen[record.key.decode()].append(runs_pb2.RunEvent.FromString(record.value))
            for run_id, run in wanted.items():
                found.extend(_event_problems(run, seen[run_id]))
    finally:
        await consumer.stop()
    return found


def _event_problems(run: Run, raw: list[runs_pb2.RunEvent]) -> list[str]:
    events = _past_fences(raw)
    terminal_at = next((i for i, e in enumerate(events) if e.type == runs_pb2.EVENT_TYPE_TERMINAL), None)
    if terminal_at is None:
        return [f"run {run.id} {run.status}: no TERMINAL event in the log"] if run.terminal_published else []
    problems = []
    head, terminal = events[:terminal_at + 1], events[terminal_at]
    if [e.sequence for e in head] != list(range(1, len(head) + 1)):
        problems.append(f"run {run.id}: sequences {[e.sequence for e in head][:12]} are not 1..n")
    if status_name(terminal.status) != run.status or terminal.sequence != run.terminal_sequence:
        problems.append(f"run {run.id}: terminal {status_name(terminal.status)}#{terminal.sequence} vs ledger"
                        f" {run.status}#{run.terminal_sequence}")
    after = [e for e in events[terminal_at + 1:] if not _same_event(e, terminal)]
    if after:
        problems.append(f"run {run.id}: {len(after)} events after its terminal"
                        f" (first seq {after[0].sequence})")
    return problems


def _past_fences(raw: list[runs_pb2.RunEvent]) -> list[runs_pb2.RunEvent]:
    """The events a reader accepts as the run's, by DESIGN.md "Leases and fencing": a reaper that
    takes a run over first appends a fence (sequence 0, its newer epoch); from there on an event of an
    older epoch (the lost owner's late write) is refused. Without this every reaped run's raw log,
    `[1, 2, 0, 3]`, read as a gap. Written from the contract, not with the readers' own code."""
    newest, kept = 0, []
    for event in raw:
        if event.lease_epoch < newest:
            continue
        newest = event.lease_epoch
        if event.sequence != 0:
            kept.append(event)
    return kept


def _same_event(event: runs_pb2.RunEvent, terminal: runs_pb2.RunEvent) -> bool:
    """A copy of the terminal as a reader delivers it, whatever its envelope (the time it was
    produced, the epoch of whoever published it): a reaper republishes a terminal whose publication
    was never recorded at its own time and epoch."""
    return _delivered(event) == _delivered(terminal)


def _delivered(event: runs_pb2.RunEvent) -> runs_pb2.RunEvent:
    content = runs_pb2.RunEvent()
    content.CopyFrom(event)
    content.ClearField("time_ms")
    content.ClearField("lease_epoch")
    return content


# --- driving a scenario -------------------------------------------------------------------------


@dataclass(slots=True)
class Load:
    """Runs submitted and streamed while a fault happens."""

    stack: Stack
    run_ids: list[str] = field(default_factory=list)
    streams: dict[str, list[runs_pb2.RunEvent]] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def submit(self, sdk: SluiceClient, count: int, max_output_tokens: int, prompt: str) -> list[str]:
        runs = await asyncio.gather(*(self._submit(sdk, f"{prompt} #{i}", max_output_tokens)
                                      for i in range(count)))
        ids = [run.run_id for run in runs]
        self.run_ids.extend(ids)
        for run_id in ids:
            self._tasks.append(asyncio.create_task(self._stream(sdk, run_id)))
        return ids

    @staticmethod
    async def _submit(sdk: SluiceClient, prompt: str, max_output_tokens: int) -> admission_pb2.SubmitResponse:
        """As a client should: an UNAVAILABLE Submit (the gateway met a pooled connection a PostgreSQL
        restart closed) is retried with the same request key, which admits the run at most once."""
        key = uuid.uuid4().hex
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                return await sdk.submit(prompt, max_output_tokens=max_output_tokens, request_key=key)
            except SluiceError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt + 1 == SUBMIT_ATTEMPTS:
                    raise
                await asyncio.sleep((error.retry_after_ms or 200) / 1000)
        raise AssertionError("unreachable")

    async def _stream(self, sdk: SluiceClient, run_id: str) -> None:
        events = self.streams.setdefault(run_id, [])
        async for event in sdk.stream(run_id):
            events.append(event)

    async def finish(self, timeout_s: float) -> list[str]:
        """Wait for every stream to end; the problems of those that did not or broke."""
        if not self._tasks:
            return []
        done, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
        problems = [f"{len(pending)} streams still open after {timeout_s:.0f} s"] if pending else []
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                problems.append(f"a stream failed: {task.exception()!r}"[:200])
        return problems


async def wait_all_terminal(sessions: async_sessionmaker[AsyncSession], run_ids: Sequence[str],
                            timeout_s: float) -> list[str]:
    ids = [uuid.UUID(run_id) for run_id in run_ids]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with sessions() as session:
                open_runs = (await session.execute(
                    select(Run.id, Run.status).where(Run.id.in_(ids),
                                                     Run.status.not_in(list(TERMINAL_STATUSES))
                                                     | ~Run.terminal_published))).all()
        except DBAPIError as error:
            # A pooled connection a PostgreSQL restart closed (no pre-ping): SQLAlchemy discards the
            # pool on this error, so the next read connects afresh.
            if not error.connection_invalidated or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        if not open_runs:
            return []
        if time.monotonic() > deadline:
            return [f"{len(open_runs)} runs not terminal+published after {timeout_s:.0f} s"
                    f" (e.g. {open_runs[0].id} {open_runs[0].status})"]
        await asyncio.sleep(0.2)


async def conclude(result: ChaosResult, load: Load, started: float, *, stream_timeout_s: float = 60.0,
                   terminal_timeout_s: float = 30.0) -> ChaosResult:
    """Wait for the load to end, then record statuses and every invariant violation."""
    stack = load.stack
    result.violations.extend(await load.finish(stream_timeout_s))
    result.violations.extend(await wait_all_terminal(stack.sessionmaker, load.run_ids, terminal_timeout_s))
    async with stack.sessionmaker() as session:
        ids = [uuid.UUID(run_id) for run_id in load.run_ids]
        runs = (await session.scalars(select(Run).where(Run.id.in_(ids)))).all()
    result.runs = len(runs)
    result.statuses.update(run.status for run in runs)
    result.interrupted_because.update((run.detail or "")[:48] for run in runs
                                      if run.status == RunStatus.INTERRUPTED.value)
    result.violations.extend(await ledger_violations(stack.sessionmaker))
    result.violations.extend(await log_violations(str(stack.events.bootstrap), stack.events.topic, runs))
    by_id = {str(run.id): run for run in runs}
    for run_id, events in load.streams.items():
        sequences = [event.sequence for event in events]
        if sequences != list(range(1, len(events) + 1)):
            result.violations.append(f"stream of {run_id}: sequences {sequences[:12]} not 1..n")
        elif not events or status_name(events[-1].status) != by_id[run_id].status:
            last = status_name(events[-1].status) if events else "nothing"
            result.violations.append(f"stream of {run_id} ended with {last},"
                                     f" ledger says {by_id[run_id].status}")
    result.seconds = time.monotonic() - started
    RESULTS.append(result)
    return result


def expect_no_healthy_run_interrupted(result: ChaosResult) -> None:
    """Healthy runs complete (DESIGN.md "Leases and fencing": a busy process or a database blip
    shorter than the lease never interrupts a healthy run)."""
    interrupted = result.statuses[RunStatus.INTERRUPTED]
    why = "; ".join(f"{count}x {detail}" for detail, count in result.interrupted_because.most_common(2))
    assert not interrupted, (f"{interrupted} of {result.runs} healthy runs INTERRUPTED ({why});"
                             f" load average {load_average()}")


def load_average() -> str:
    """The box's 1/5/15-minute load average, reported with every count (a 2-core box is shared)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f}/{five:.1f}/{fifteen:.1f}"


async def during(seconds: float, check: Callable[[], Awaitable[list[str]]], into: list[str]) -> None:
    """Run `check` every 0.5 s for `seconds`, collecting what it reports (deduplicated)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for problem in await check():
            if problem not in into:
                into.append(problem)
        await asyncio.sleep(0.5)
