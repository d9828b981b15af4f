"""Which database errors are transient: the connection (or the server's availability) failed, not
the statement. One answer for SQLAlchemy's wrapped errors and raw asyncpg's (ledger/pg.py), used
by the RPC edge (UNAVAILABLE, not INTERNAL: services/errors.py). The routing driver's writes retry
within the lease on `retryable` errors: those, and a transaction rolled back for losing a race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
from sqlalchemy import exc as sa_exc

_CONNECTION_ERRORS = (OSError, ConnectionError, asyncio.TimeoutError, asyncpg.InterfaceError,
                      asyncpg.PostgresConnectionError, asyncpg.exceptions.AdminShutdownError,
                      asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.CrashShutdownError)


# asyncpg's protocol left mid-operation by a connection the server terminated (a PostgreSQL
# restart): "cannot switch to state 15; another operation (2) is in progress" on the COMMIT. Seen
# crashing a driver's settlement in the chaos suite's restarts, so the run ended INTERRUPTED.
_BROKEN_PROTOCOL = "cannot switch to state"


# SQLSTATE class 40, transaction rollback: the statement lost a race with another transaction
# (deadlock_detected 40P01, serialization_failure 40001). PostgreSQL rolled it back whole, so the
# same statement may run again; a routing driver that gave up instead ended a healthy run INTERRUPTED
# (bench-platform's run-cost phase: 3 of 600, a batched settlement against a batched start record).
_LOST_RACE = (asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError)


def transient(error: BaseException | None) -> bool:
    """A database error worth retrying: the connection (or the server's availability), not the
    statement, failed. SQLAlchemy wraps the driver's error: the whole cause chain is looked at."""
    return _in_chain(error, _connection_failed)


def retryable(error: BaseException | None) -> bool:
    """A write worth sending again as it is: `transient`, or its transaction lost a race (a deadlock,
    a serialization failure) and was rolled back whole."""
    return _in_chain(error, lambda cause: _connection_failed(cause) or isinstance(cause, _LOST_RACE))


def _connection_failed(error: BaseException) -> bool:
    if isinstance(error, _CONNECTION_ERRORS):
        return True
    if isinstance(error, asyncpg.exceptions.InternalClientError) and _BROKEN_PROTOCOL in str(error):
        return True
    return isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated


def _in_chain(error: BaseException | None, found: Callable[[BaseException], bool]) -> bool:
    """Whether `found` holds for `error` or anything in its cause chain (SQLAlchemy's `orig`, the
    cause and the context), looked at up to 16 deep."""
    pending, seen = [error], 0
    while pending and seen < 16:
        error = pending.pop()
        seen += 1
        if error is None:
            continue
        if found(error):
            return True
        pending.extend((getattr(error, "orig", None), error.__cause__, error.__context__))
    return False
