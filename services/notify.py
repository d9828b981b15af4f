"""Postgres LISTEN/NOTIFY as a wake-up signal between processes.

Every ChannelListener of a process (of one event loop, for one database) shares ONE listening
connection, whatever its channel: a NOTIFY wakes every backend that LISTENs in its database, on any
channel (PostgreSQL 15 signals them all and each filters), ~30 us of backend CPU per listening
backend per NOTIFY and ~14 us more for the sender per backend signalled. The routing process
listened on three connections (new runs, cancels, the replica registry) and so paid three wake-ups
per notification of any kind, about two NOTIFYs per run (admission's, RUNNING's): issue 9.

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
    """LISTEN for one channel, on the process's shared listening connection (reconnecting until
    closed).

    Either hand it a callback (`on_payload`), or wait for a payload with `waiter`.
    """

    def __init__(self, dsn: str, channel: str, on_payload: Callable[[str], None] | None = None,
                 on_connect: Callable[[], None] | None = None, remember: int = 0) -> None:
        self._dsn = asyncpg_dsn(dsn)
        self.channel = channel
        self._on_payload = on_payload
        self._on_connect = on_connect    # called each time LISTEN is (re)established
        self.listening = False           # LISTEN is established now: notifications arrive
        self._waiters: dict[str, set[asyncio.Event]] = {}
        # The last `remember` payloads heard, oldest first (`heard`): for a channel whose payloads
        # state lasting facts, a caller that registers its waiter only after the NOTIFY may have gone
        # by asks here instead of waiting for it.
        self._remember = remember
        self._heard: dict[str, None] = {}
        self._shared: _SharedConnection | None = None
        self._connection_seen = 0        # the shared connection's generation this one was told of

    def start(self) -> None:
        if self._shared is None:
            self._shared = _SharedConnection.of(self._dsn)
            self._shared.join(self)

    async def close(self) -> None:
        shared, self._shared = self._shared, None
        self.listening = False
        if shared is not None:
            await shared.leave(self)

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

    def heard(self, payload: str) -> bool:
        """`payload` was notified on this listener's connection, among the last `remember` payloads.
        False says nothing: not heard yet, forgotten, or lost while the listener reconnected."""
        return payload in self._heard

    def _deliver(self, payload: str) -> None:
        if self._remember:
            heard = self._heard
            heard.pop(payload, None)
            heard[payload] = None
            if len(heard) > self._remember:
                del heard[next(iter(heard))]
        if self._on_payload is not None:
            self._on_payload(payload)
        for event in self._waiters.get(payload, ()):
            event.set()

    def _established(self, generation: int) -> None:
        """LISTEN for this channel is up on connection `generation` (a new one after a reconnect)."""
        self._connection_seen = generation
        self.listening = True
        # Whatever was notified while no connection listened is lost: every waiter re-checks.
        for waiting in self._waiters.values():
            for event in waiting:
                event.set()
        if self._on_connect is not None:
            self._on_connect()


class _SharedConnection:
    """The one listening connection of a process (per event loop and database): LISTENs for every
    channel its members follow, dispatches each notification to the members of its channel, and
    reconnects until the last member leaves."""

    _open: dict[tuple[asyncio.AbstractEventLoop, str], _SharedConnection] = {}

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._members: list[ChannelListener] = []
        self._generation = 0             # +1 per connection established
        self._changed = asyncio.Event()  # a member joined or left: LISTEN for new channels, or end
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, dsn: str) -> _SharedConnection:
        key = (asyncio.get_running_loop(), dsn)
        shared = cls._open.get(key)
        if shared is None:
            shared = cls._open[key] = cls(dsn)
        return shared

    def join(self, member: ChannelListener) -> None:
        self._members.append(member)
        self._changed.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="listen")

    async def leave(self, member: ChannelListener) -> None:
        if member in self._members:
            self._members.remove(member)
        self._changed.set()
        if self._members or self._task is None:
            return
        self._open.pop((asyncio.get_running_loop(), self._dsn), None)
        task, self._task = self._task, None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while self._members:
            try:
                await self._listen_until_closed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("LISTEN %s: %s; reconnecting",
                            ", ".join(sorted({member.channel for member in self._members})), exc)
            for member in self._members:
                member.listening = False
            if self._members:
                await asyncio.sleep(RECONNECT_S)

    async def _listen_until_closed(self) -> None:
        conn = await asyncpg.connect(self._dsn)
        self._generation += 1
        closed = asyncio.Event()
        conn.add_termination_listener(lambda _conn: closed.set())
        listened: set[str] = set()
        try:
            while self._members:
                self._changed.clear()
                for channel in listened - {member.channel for member in self._members}:
                    await conn.remove_listener(channel, self._dispatch)
                    listened.discard(channel)
                for member in list(self._members):
                    if member.channel not in listened:
                        await conn.add_listener(member.channel, self._dispatch)
                        listened.add(member.channel)
                    if member._connection_seen != self._generation and member in self._members:
                        member._established(self._generation)
                await _first_set(closed, self._changed)
                if closed.is_set():
                    raise ConnectionError("the listening connection was closed")
        finally:
            with contextlib.suppress(Exception):
                await conn.close()

    def _dispatch(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        for member in list(self._members):
            if member.channel == channel:
                member._deliver(payload)


async def _first_set(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
