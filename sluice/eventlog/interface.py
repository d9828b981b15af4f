"""The event-log interface: what the run driver, the reaper and Runs.Stream need.

One backend today (Kafka, eventlog/kafka.py); the interface keeps the services
free of broker details, and a second backend (or an in-memory one for pure
tests) plugs in behind the same three verbs: append, read what is durable,
follow live.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from sluice.v1 import runs_pb2

CURSOR_PAST_RETENTION = (
    "the events of run {run_id} after sequence {after} are past the event log's retention; "
    "fetch the run's final state with GetRun instead"
)


class CursorPastRetention(Exception):
    """The run's first events were deleted by retention: no gap-free replay is possible."""

    def __init__(self, run_id: str, after: int) -> None:
        super().__init__(CURSOR_PAST_RETENTION.format(run_id=run_id, after=after))
        self.run_id = run_id
        self.after = after


READER_TOO_SLOW = (
    "stream of run {run_id} cut off: more than {capacity} events waited for this reader;"
    " resume with after={after} and read faster"
)


class ReaderTooSlow(Exception):
    """A follower fell too far behind the log and was cut off (its buffer is bounded)."""

    def __init__(self, run_id: str, after: int, capacity: int) -> None:
        super().__init__(READER_TOO_SLOW.format(run_id=run_id, capacity=capacity, after=after))
        self.run_id = run_id
        self.after = after


LOG_UNAVAILABLE = (
    "stream of run {run_id} broken: the event log cannot be read right now ({error}); resume with"
    " after=<the last sequence received>"
)


class LogUnavailable(Exception):
    """The log cannot be read now (the live tail lost its consumer, a broker is unreachable):
    transient, and a reader resumes by cursor once it answers again."""

    def __init__(self, run_id: str, error: BaseException) -> None:
        super().__init__(LOG_UNAVAILABLE.format(run_id=run_id, error=type(error).__name__))
        self.run_id = run_id


@dataclass(frozen=True, slots=True)
class LogPosition:
    """Where an event sits in the log; a run's events all share one partition."""

    partition: int
    offset: int


class EventLog(Protocol):
    async def publish(self, event: runs_pb2.RunEvent, *,
                      at_once: bool = False) -> asyncio.Future[LogPosition]:
        """Enqueue one event (key = its run id) after every event published before it; the future
        resolves once it is durable. Many may be in flight; a run's order is kept. `at_once`: send it,
        and what waits before it, without waiting to batch it with others (a run's first token)."""
        ...

    async def append(self, event: runs_pb2.RunEvent) -> LogPosition:
        """Publish one event (key = its run id) and wait until it is durable: within the process's
        window like publish(), not at once, but leaving soon (a terminal event, a fence: the
        caller waits for it)."""
        ...

    async def locate(self, run_id: str, since_ms: int) -> LogPosition | None:
        """Where a run's events begin when the ledger never recorded it (a driver died
        between publishing the first event and committing its position): the run's
        partition at the first offset written at or after `since_ms`; None if nothing
        was written since."""
        ...

    async def read_durable(self, run_id: str, start: LogPosition) -> list[runs_pb2.RunEvent]:
        """The run's events durable now, from `start` to the current end, de-duplicated."""
        ...

    def follow(self, run_id: str, start: LogPosition, after: int) -> AsyncIterator[runs_pb2.RunEvent]:
        """Every event of the run with sequence > after, replayed then live, ending with
        its terminal event. Raises CursorPastRetention when `start` was deleted, and
        ReaderTooSlow when the caller stops reading for too long (after= the last
        event it got)."""
        ...

    def follow_from_first(self, run_id: str, after: int,
                          recorded_start: Callable[[], Awaitable[LogPosition | None]],
                          first_recorded: Callable[[], Awaitable[object]] | None = None,
                          ) -> AsyncIterator[runs_pb2.RunEvent]:
        """follow() for a run whose start the ledger has not recorded yet. Live events are watched
        from now on, after any the process still holds of the run: if the first of them is the run's
        first event (sequence 1), nothing needs replaying; it is handed over once `first_recorded()` returns
        (the ledger has committed the transition that event announces). Otherwise `recorded_start()`
        (which waits for the ledger) says where to replay from, None meaning nothing is left to read."""
        ...

    def hurry(self) -> None:
        """A live reader's next event is durable, or about to be (the ledger committed the transition
        it announces): have it read as soon as the log has it, not at the next batch of the live tail."""
        ...

    async def close(self) -> None:
        ...
