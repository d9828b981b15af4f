"""Which database errors a driver retries within its lease (services/routing/run_ledger.py)."""

from __future__ import annotations

import asyncpg
from sluice.ledger.transient import transient


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
