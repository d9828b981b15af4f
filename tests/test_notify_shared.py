"""A process's ChannelListeners share one listening connection (services/notify.py), on the real
PostgreSQL: a NOTIFY on any channel wakes every listening backend of the database, so the routing
process's three channels on three connections were three wake-ups per notification (issue 9)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sluice.ledger.pg import asyncpg_dsn
from sluice.services.notify import ChannelListener

pytestmark = pytest.mark.integration

CHANNELS = ("test_runs", "test_cancels", "test_replicas")
WITHIN_S = 10.0

# Backends of this database that LISTEN on anything (pg_stat_activity shows each one's last statement).
_LISTENING = """
SELECT pid FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE 'LISTEN%'
"""


async def until(condition, timeout_s: float = WITHIN_S) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not await condition():
        assert time.monotonic() - started < timeout_s, "not within the time allowed"
        await asyncio.sleep(0.02)


class Heard:
    def __init__(self) -> None:
        self.payloads: dict[str, list[str]] = {channel: [] for channel in CHANNELS}
        self.connects: dict[str, int] = {channel: 0 for channel in CHANNELS}

    def listener(self, dsn: str, channel: str) -> ChannelListener:
        def connected() -> None:
            self.connects[channel] += 1
        return ChannelListener(dsn, channel, self.payloads[channel].append, on_connect=connected)


async def all_listening(listeners: list[ChannelListener]) -> bool:
    return all(listener.listening for listener in listeners)


@contextlib.asynccontextmanager
async def listening(dsn: str, heard: Heard) -> AsyncIterator[asyncpg.Connection]:
    """A listener per channel, all LISTENing, and an admin connection that notifies; closed after."""
    listeners = [heard.listener(dsn, channel) for channel in CHANNELS]
    admin = await asyncpg.connect(asyncpg_dsn(dsn))
    try:
        for listener in listeners:
            listener.start()
        await until(lambda: all_listening(listeners))
        yield admin
    finally:
        for listener in listeners:
            await listener.close()
        await admin.close()


async def test_three_channels_of_one_process_listen_on_one_backend_and_each_hears_only_its_own(
        database_dsn: str):
    heard = Heard()
    async with listening(database_dsn, heard) as admin:
        assert len(await admin.fetch(_LISTENING)) == 1
        for index, channel in enumerate(CHANNELS):
            await admin.execute("SELECT pg_notify($1, $2)", channel, f"p{index}")

        async def delivered() -> bool:
            return all(heard.payloads[channel] for channel in CHANNELS)
        await until(delivered)
        assert heard.payloads == {"test_runs": ["p0"], "test_cancels": ["p1"], "test_replicas": ["p2"]}
        assert heard.connects == {channel: 1 for channel in CHANNELS}


async def test_when_the_shared_connection_dies_every_channel_is_told_it_listens_again(database_dsn: str):
    """Notifications sent while no connection listened are lost: each member's on_connect (its cue to
    re-read the ledger) runs again once the new connection LISTENs for its channel."""
    heard = Heard()
    async with listening(database_dsn, heard) as admin:
        [old] = [row["pid"] for row in await admin.fetch(_LISTENING)]
        await admin.execute("SELECT pg_terminate_backend($1)", old)

        async def reconnected() -> bool:
            return heard.connects == {channel: 2 for channel in CHANNELS}
        await until(reconnected)
        [new] = [row["pid"] for row in await admin.fetch(_LISTENING)]
        assert new != old
        await admin.execute("SELECT pg_notify($1, 'again')", CHANNELS[1])

        async def delivered() -> bool:
            return heard.payloads[CHANNELS[1]] == ["again"]
        await until(delivered)


async def test_a_channel_whose_listener_closed_is_no_longer_heard_and_the_last_close_ends_the_connection(
        database_dsn: str):
    heard = Heard()
    runs, cancels = heard.listener(database_dsn, CHANNELS[0]), heard.listener(database_dsn, CHANNELS[1])
    admin = await asyncpg.connect(asyncpg_dsn(database_dsn))
    try:
        runs.start()
        cancels.start()
        await until(lambda: all_listening([runs, cancels]))
        await runs.close()
        await admin.execute("SELECT pg_notify($1, 'late')", CHANNELS[0])
        await admin.execute("SELECT pg_notify($1, 'heard')", CHANNELS[1])

        async def delivered() -> bool:
            return heard.payloads[CHANNELS[1]] == ["heard"]
        await until(delivered)
        assert heard.payloads[CHANNELS[0]] == []
        await cancels.close()

        async def gone() -> bool:
            return not await admin.fetch(_LISTENING)
        await until(gone)
    finally:
        await runs.close()
        await cancels.close()
        await admin.close()
