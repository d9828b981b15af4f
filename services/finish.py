"""How a run ends, whoever ends it (its driver, a reaper, Runs.Cancel, the claim loop).

    1. one transaction: settle_run (status, usage, budget) + terminal_sequence
       + a short lease for whoever publishes next
    2. publish the TERMINAL event (sequence = terminal_sequence, usage inside)
    3. terminal_published = true

A crash between 1 and 3 leaves a settled run with terminal_published=false;
once the lease from step 1 lapses, any routing process's reaper republishes
the same event (same sequence, same usage), and readers drop the duplicate if
both copies made it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.db import autocommit_engine
from sluice.ledger.models import Run, RunStatus
from sluice.ledger.pg import Executor, HotPool
from sluice.ledger.runs_sql import mark_published
from sluice.ledger.settlement import (
    OwnedSettlement,
    SettledUsage,
    TerminalFix,
    settle_run_usage,
    settled_usage,
)
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.events import status_value, terminal_event
from sluice.eventlog.interface import EventLog, LogPosition
from sluice.v1 import common_pb2, runs_pb2


@dataclass(frozen=True, slots=True)
class Ending:
    status: RunStatus
    last_sequence: int           # last event of the run durable in the log
    output_tokens: int           # tokens in the run's durable DELTA events
    detail: str | None = None
    first: LogPosition | None = None   # where the run's events start, if the ledger lacks it
    cached_input_tokens: int = 0       # prompt tokens the replica served from its prefix cache
    # Whether a replica took the prompt (produced output, or held the request until stopped). False
    # when every replica tried refused or failed before any output: the prompt is then not charged.
    # None: the settlement's default (charged when the run was handed to a replica), for enders
    # that cannot tell (a reaper).
    prompt_taken: bool | None = None


@dataclass(frozen=True, slots=True)
class TerminalRecord:
    """A settled run's terminal event, as the ledger fixes it (republishable verbatim)."""

    run_id: str
    sequence: int
    status: RunStatus
    usage: common_pb2.TokenUsage
    detail: str
    epoch: int = 0               # lease epoch of whoever publishes it (stamped on the event)


async def settle_and_fix_terminal(session: Executor, run_id: str, ending: Ending, owner: str,
                                  lease_seconds: float, epoch: int = 0,
                                  owned: bool = False) -> TerminalRecord | None:
    """Step 1, inside the caller's transaction. None when the run was already settled. `owned`: only
    while the run is active under `epoch` (NotOwned otherwise, nothing written)."""
    untaken = ending.prompt_taken is False
    settled = await settle_run_usage(session, run_id, ending.status, output_tokens=ending.output_tokens,
                                     cached_input_tokens=0 if untaken else ending.cached_input_tokens,
                                     detail=ending.detail, input_tokens=0 if untaken else None,
                                     owned_by_epoch=epoch if owned else None,
                                     terminal=_terminal_fix(ending, owner, lease_seconds))
    if settled is None:
        return None
    # What was just settled is the record: no need to read it back.
    return settled_record(run_id, ending, settled, epoch)


def owned_settlement(run_id: str, ending: Ending, owner: str, lease_seconds: float,
                     epoch: int) -> OwnedSettlement:
    """Step 1 as its lease holder asks it of the ledger for many runs at once (settle_owned_many);
    settle_and_fix_terminal(owned=True) for one."""
    untaken = ending.prompt_taken is False
    return OwnedSettlement(uuid.UUID(run_id), epoch, ending.status, ending.output_tokens,
                           0 if untaken else ending.cached_input_tokens, ending.detail,
                           0 if untaken else None, _terminal_fix(ending, owner, lease_seconds))


def settled_record(run_id: str, ending: Ending, settled: SettledUsage, epoch: int) -> TerminalRecord:
    """The terminal event's record of a run just settled as `ending`."""
    return _record(run_id, ending.last_sequence + 1, settled, ending.detail, epoch)


def _terminal_fix(ending: Ending, owner: str, lease_seconds: float) -> TerminalFix:
    first = ending.first
    return TerminalFix(sequence=ending.last_sequence + 1, last_sequence=ending.last_sequence,
                       lease_owner=owner, lease_seconds=lease_seconds,
                       first_partition=None if first is None else first.partition,
                       first_offset=None if first is None else first.offset)


async def terminal_record(session: AsyncSession, run_id: str, sequence: int, epoch: int) -> TerminalRecord:
    """A settled run's record read back from the ledger (the reaper's republish)."""
    usage = await settled_usage(session, run_id)
    assert usage is not None, f"run {run_id} has a terminal sequence but no settlement"
    # A column select, not session.get: settle_run updated the row behind the identity map.
    detail = await session.scalar(select(Run.detail).where(Run.id == uuid.UUID(run_id)))
    return _record(run_id, sequence, usage, detail, epoch)


def _record(run_id: str, sequence: int, usage: SettledUsage, detail: str | None,
            epoch: int) -> TerminalRecord:
    return TerminalRecord(
        run_id=run_id, sequence=sequence, status=usage.status,
        usage=common_pb2.TokenUsage(input_tokens=usage.input_tokens,
                                    cached_input_tokens=usage.cached_input_tokens,
                                    output_tokens=usage.output_tokens, cost_micros=usage.cost_micros),
        detail=detail or "", epoch=epoch,
    )


def terminal_event_of(record: TerminalRecord) -> runs_pb2.RunEvent:
    """The TERMINAL event of `record`, produced now."""
    return terminal_event(record.run_id, record.sequence, status_value(record.status.value),
                          record.usage, record.detail, int(time.time() * 1000), record.epoch)


async def publish_terminal(log: EventLog, sessions: async_sessionmaker[AsyncSession],
                           record: TerminalRecord, pool: HotPool | None = None) -> LogPosition:
    """Steps 2 and 3 (step 3 on `pool`'s connection when given, see record_published)."""
    position = await log.append(terminal_event_of(record))
    await record_published(sessions, record, position, pool)
    return position


async def record_published(sessions: async_sessionmaker[AsyncSession], record: TerminalRecord,
                           position: LogPosition, pool: HotPool | None = None) -> None:
    """Step 3: one autocommit statement that also notifies the run's Streams. Idempotent (a retry
    after a lost acknowledgment writes the same values). On `pool`'s connection when given (the
    routing worker's hot path, ledger/pg.py)."""
    if pool is not None:
        async with pool.connection() as hot:
            await mark_published(hot, record.run_id, record.sequence, position, EVENTS_CHANNEL)
        return
    async with autocommit_engine(sessions).connect() as connection:
        await mark_published(connection, record.run_id, record.sequence, position, EVENTS_CHANNEL)
