"""Which database errors a driver retries within its lease (services/routing/run_ledger.py)."""

from __future__ import annotations

import asyncpg
from sluice.ledger.transient import retryable, transient
from sluice.services.routing import run_ledger


def test_a_connection_the_server_terminated_is_retried_and_a_bad_statement_is_not():
    broken = asyncpg.exceptions.InternalClientError(
        "cannot switch to state 15; another operation (2) is in progress")
    assert transient(broken)
    assert transient(asyncpg.exceptions.AdminShutdownError("terminating connection"))
    wrapped = RuntimeError("settlement failed")
    wrapped.__cause__ = broken
    assert transient(wrapped)                                     # the cause chain is followed
    assert not transient(asyncpg.exceptions.InternalClientError("unexpected message type"))
    assert not transient(asyncpg.exceptions.UniqueViolationError("duplicate key"))
    assert not transient(None)


def test_a_transaction_rolled_back_for_losing_a_race_is_retryable_but_says_nothing_of_the_connection():
    deadlock = asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
    wrapped = RuntimeError("settlement failed")
    wrapped.__context__ = deadlock
    for lost in (deadlock, asyncpg.exceptions.SerializationError("could not serialize access"), wrapped):
        assert retryable(lost) and not transient(lost)
    assert retryable(asyncpg.exceptions.AdminShutdownError("terminating connection"))
    assert not retryable(asyncpg.exceptions.UniqueViolationError("duplicate key"))
    assert not retryable(None)


async def test_a_driver_write_that_lost_a_deadlock_is_sent_again_within_the_lease(monkeypatch):
    monkeypatch.setattr(run_ledger, "RETRY_S", 0.0)
    attempts = []

    async def settle() -> str:
        attempts.append(len(attempts))
        if len(attempts) == 1:
            raise asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
        return "settled"

    assert await run_ledger._retried("run-1", settle, lambda: True) == "settled"
    assert attempts == [0, 1]
