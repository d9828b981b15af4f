"""Postgres LISTEN/NOTIFY as a wake-up signal between processes.

A NOTIFY issued inside a transaction is delivered only when that transaction
commits, so a listener woken by it always finds the committed state when it
re-reads the ledger. Notifications are a latency optimisation only: they are
lost while a listener reconnects, so every waiter is woken once the listener is
(re)connected (it re-reads what it waits for) and also re-polls the ledger on a
timeout; correctness never depends on a notification arriving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import asyncpg
from sluice.ledger.pg import asyncpg_dsn as asyncpg_dsn  # re-exported: bench imports it from here
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

log = logging.getLogger(__name__)

RECONNECT_S = 1.0


async def notify(session: AsyncSession, channel: str, payload: str) -> None:
    """NOTIFY in the caller's transaction (delivered on commit)."""
    await session.execute(text("SELECT pg_notify(:channel, :payload)"),
                          {"channel": channel, "payload": payload})



class ChannelListener:
    """One LISTEN connection per process and channel, reconnecting until closed.

    Either hand it a callback (`on_payload`), or wait for a payload with `waiter`.
    """

    def __init__(self, dsn: str, channel: str, on_payload: Callable[[str], None] | None = None,
                 on_connect: Callable[[], None] | None = None) -> None:
        self._dsn = asyncpg_dsn(dsn)
        self.channel = channel
        self._on_payload = on_payload
        self._on_connect = on_connect    # called each time LISTEN is (re)established
        self.listening = False           # LISTEN is established now: notifications arrive
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"listen-{self.channel}")

    async def close(self) -> None:
        self._closing.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @contextlib.contextmanager
    def waiter(self, payload: str) -> Iterator[asyncio.Event]:
        """An event set when `payload` is notified. Register before re-checking state, so a
        NOTIFY committed in between is not missed."""
        self.start()
        event = asyncio.Event()
        self._waiters.setdefault(payload, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._waiters.get(payload)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[payload]

    def _dispatch(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if self._on_payload is not None:
            self._on_payload(payload)
        for event in self._waiters.get(payload, ()):
            event.set()

    async def _run(self) -> None:
        while not self._closing.is_set():
            try:
                await self._listen_until_closed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("LISTEN %s: %s; reconnecting", self.channel, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), RECONNECT_S)

    async def _listen_until_closed(self) -> None:
        conn = await asyncpg.connect(self._dsn)
        closed = asyncio.Event()
        conn.add_termination_listener(lambda _conn: closed.set())
        waits = [asyncio.ensure_future(closed.wait()), asyncio.ensure_future(self._closing.wait())]
        try:
            await conn.add_listener(self.channel, self._dispatch)
            self.listening = True
            # Whatever was notified while no connection listened is lost: every waiter re-checks.
            for waiting in self._waiters.values():
                for event in waiting:
                    event.set()
            if self._on_connect is not None:
                self._on_connect()
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.listening = False
            for wait in waits:
                wait.cancel()
            with contextlib.suppress(Exception):
                await conn.close()
