"""Which database errors are transient: the connection (or the server's availability) failed, not
the statement. One answer for SQLAlchemy's wrapped errors and raw asyncpg's (ledger/pg.py), used
by the routing driver (retry within the lease) and the RPC edge (UNAVAILABLE, not INTERNAL:
services/errors.py).
"""

from __future__ import annotations

import asyncio

import asyncpg
from sqlalchemy import exc as sa_exc

_CONNECTION_ERRORS = (OSError, ConnectionError, asyncio.TimeoutError, asyncpg.InterfaceError,
                      asyncpg.PostgresConnectionError, asyncpg.exceptions.AdminShutdownError,
                      asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.CrashShutdownError)


# asyncpg's protocol left mid-operation by a connection the server terminated (a PostgreSQL
# restart): "cannot switch to state 15; another operation (2) is in progress" on the COMMIT. Seen
# crashing a driver's settlement in the chaos suite's restarts, so the run ended INTERRUPTED.
_BROKEN_PROTOCOL = "cannot switch to state"


def transient(error: BaseException | None) -> bool:
    """A database error worth retrying: the connection (or the server's availability), not the
    statement, failed. SQLAlchemy wraps the driver's error: the whole cause chain is looked at."""
    pending, seen = [error], 0
    while pending and seen < 16:
        error = pending.pop()
        seen += 1
        if error is None:
            continue
        if isinstance(error, _CONNECTION_ERRORS):
            return True
        if isinstance(error, asyncpg.exceptions.InternalClientError) and _BROKEN_PROTOCOL in str(error):
            return True
        if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
            return True
        pending.extend((getattr(error, "orig", None), error.__cause__, error.__context__))
    return False
