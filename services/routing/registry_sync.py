"""Keep a routing process's replica registry equal to the durable one (ledger/replicas.py).

The registry starts from config (`[[replicas]]`, the bootstrap). This component then applies the
rows of the `replicas` table over it: a row replaces the replica of its name, a tombstone removes
it. It re-reads the whole table (tens of rows) when the Admin API's NOTIFY arrives, each time its
LISTEN is (re)established (what was notified meanwhile is lost), and on a timer as the safety net:
every `poll_s` while no LISTEN is up, every `listening_poll_s` while one is (the NOTIFY then
brings every change; the old 0.5 s poll cost a session transaction, three statements, twice a
second in every routing process, issue 9). A change is seen by every routing process within
milliseconds usually, a poll interval at worst.

A row is applied when its revision differs from the one last applied for that name, never by
"revision > highest seen": two admin transactions can commit their revisions out of order.
Edits made through a routing process's own Routing API stay in that process's memory until a
durable row of the same name changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sluice.ledger.channels import REPLICAS_CHANNEL
from sluice.ledger.replicas import ReplicaRecord, ReplicaRepository, fields_of
from sluice.services.notify import ChannelListener
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.router.registry import ReplicaRegistry, ReplicaSpec

log = logging.getLogger(__name__)

POLL_S = 0.5             # without a LISTEN
LISTENING_POLL_S = 10.0  # with one up


def spec_of(row: ReplicaRecord) -> ReplicaSpec:
    return ReplicaSpec(**fields_of(row))


class RegistrySync:
    def __init__(
        self,
        registry: ReplicaRegistry,
        sessions: async_sessionmaker[AsyncSession],
        dsn: str | None,
        on_change: Callable[[], None] = lambda: None,
        poll_s: float = POLL_S,
        listening_poll_s: float = LISTENING_POLL_S,
    ) -> None:
        self._registry = registry
        self._sessions = sessions
        self._on_change = on_change
        self._poll_s = poll_s
        self._listening_poll_s = listening_poll_s
        self._applied: dict[str, int] = {}  # name → revision of the row last applied
        self.reads = 0                      # table reads so far
        self._wake = asyncio.Event()
        self._listener = (
            None if dsn is None else ChannelListener(dsn, REPLICAS_CHANNEL, lambda _name: self._wake.set(),
                                                     on_connect=self._wake.set)
        )
        self._task: asyncio.Task[None] | None = None

    async def sync_once(self) -> bool:
        """Apply the rows changed since they were last applied; True when the registry changed."""
        self.reads += 1
        async with self._sessions() as session:
            rows = await ReplicaRepository(session).all()
        changed = False
        for row in rows:
            if self._applied.get(row.name) == row.revision:
                continue
            if row.removed:
                self._registry.remove(row.name)
            else:
                self._registry.upsert(spec_of(row))
            self._applied[row.name] = row.revision
            changed = True
            log.info(
                "replica registry: %s %s (revision %d)",
                "removed" if row.removed else "set",
                row.name,
                row.revision,
            )
        if changed:
            self._on_change()
        return changed

    def start(self) -> None:
        if self._listener is not None:
            self._listener.start()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="replica-registry-sync")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._listener is not None:
            await self._listener.close()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.sync_once()
            except Exception:
                log.exception("replica registry sync failed; retrying")
            listening = self._listener is not None and self._listener.listening
            interval = self._listening_poll_s if listening else self._poll_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)


async def follow_durable_registry(
    registry: ReplicaRegistry,
    sessions: async_sessionmaker[AsyncSession],
    dsn: str,
    on_change: Callable[[], None],
) -> RegistrySync:
    """Apply the durable registry once (before a routing process's first claim), then keep
    following it; close() the result on shutdown."""
    sync = RegistrySync(registry, sessions, dsn, on_change)
    await sync.sync_once()
    sync.start()
    return sync
