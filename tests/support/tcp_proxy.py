"""A TCP proxy a test can cut: stands between a client and a real server (PostgreSQL) to make an
outage of a chosen length without touching the shared server.

    proxy = await TcpProxy.start("127.0.0.1", 54329)   # clients connect to proxy.port
    proxy, proxied_dsn = await TcpProxy.before_database(dsn)   # the same, in front of a DSN's server
    await proxy.cut(0.8)    # every connection reset, new ones refused, for 0.8 s
    proxy.lose_commit_ack(lambda sql: "queued_at" in sql)
        # the next COMMIT of a transaction that ran such a statement reaches PostgreSQL, which
        # commits it; its client's connection is then dropped before the acknowledgment arrives
    await proxy.stall(1.5)  # every byte held, both ways, for 1.5 s; no connection reset (a database
                            # that stopped answering, then goes on)
    proxy.slow(0.9)         # from now on every answer arrives 0.9 s late (0: again at once)

Losing an acknowledgment needs the PostgreSQL frontend protocol (no TLS): after the startup
message every client message is a type byte, a length and a body. Statement texts are learnt from
Parse messages (asyncpg prepares and caches them by name) and recognised in Bind; asyncpg sends
BEGIN and COMMIT as simple queries (Q).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import URL, make_url

SSL_REQUEST, GSS_REQUEST = 80877103, 80877104   # startup-phase requests a StartupMessage follows


@dataclass(slots=True, eq=False)
class TcpProxy:
    """Runs on a thread and event loop of its own, as a network would: a busy test loop (servers,
    streams, a routing worker) must not delay the bytes of a client on another thread (the lease
    keeper), or a test would measure its own proxy."""

    target_host: str
    target_port: int
    server: asyncio.Server | None = None
    port: int = 0
    down: bool = False
    cuts: int = 0
    lost_acks: int = 0
    stalls: int = 0
    delay_s: float = 0.0                               # slow(): every answer held this long
    _held_until: float = 0.0                           # stall(): bytes wait until then (own loop's clock)
    _lose_after: Callable[[str], bool] | None = None   # armed: the statement that marks the transaction
    _links: set[asyncio.StreamWriter] = field(default_factory=set)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @classmethod
    async def start(cls, target_host: str, target_port: int) -> TcpProxy:
        proxy = cls(target_host, target_port)
        proxy._loop = asyncio.new_event_loop()
        proxy._thread = threading.Thread(target=proxy._loop.run_forever, name="tcp-proxy", daemon=True)
        proxy._thread.start()
        await proxy._on_own_loop(proxy._listen())
        return proxy

    @classmethod
    async def before_database(cls, dsn: str) -> tuple[TcpProxy, str]:
        """A proxy in front of the PostgreSQL `dsn` names, and `dsn` through it. A DSN through the
        local server's unix socket ([database].socket_dir) names its port in the query; the proxy
        reaches that server on loopback TCP, as every DSN it hands out does."""
        url = make_url(dsn)
        query = dict(url.query)
        if url.host is None and "host" in query:
            del query["host"]
            url = URL.create(url.drivername, url.username, url.password, "127.0.0.1",
                             int(str(query.pop("port", 5432))), url.database, query)
        proxy = await cls.start(url.host or "127.0.0.1", url.port or 5432)
        return proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)

    async def cut(self, seconds: float) -> None:
        """Reset every open connection and refuse new ones for `seconds`."""
        await self._on_own_loop(self._cut(seconds))

    async def stall(self, seconds: float) -> None:
        """Hold every byte, both ways, on every connection (new ones too) for `seconds`; nothing is
        reset: the clients wait, then their statements run and answer."""
        await self._on_own_loop(self._stall(seconds))

    def slow(self, delay_s: float) -> None:
        """Every answer from the server reaches its client `delay_s` late (each round trip too)."""
        self.delay_s = delay_s

    async def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        await self._on_own_loop(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, 5.0)
        self._loop.close()

    async def _on_own_loop(self, step: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None, "the proxy is not started"
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(step, self._loop))

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _cut(self, seconds: float) -> None:
        self.down = True
        self.cuts += 1
        for writer in list(self._links):
            writer.transport.abort()
        await asyncio.sleep(seconds)
        self.down = False

    async def _stall(self, seconds: float) -> None:
        self.stalls += 1
        assert self._loop is not None
        self._held_until = self._loop.time() + seconds
        await asyncio.sleep(seconds)

    async def _held(self, answer: bool) -> None:
        """Wait out a stall (and, for an answer, the delay)."""
        assert self._loop is not None
        left = self._held_until - self._loop.time()
        if left > 0:
            await asyncio.sleep(left)
        if answer and self.delay_s > 0:
            await asyncio.sleep(self.delay_s)

    async def _close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self._links):
            writer.transport.abort()

    def lose_commit_ack(self, marks: Callable[[str], bool]) -> None:
        """Once: the COMMIT of the next transaction that runs a statement whose SQL `marks` is true
        reaches the server, and the client loses its connection instead of the answer."""
        self._lose_after = marks

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        try:
            upstream = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        upstream_reader, upstream_writer = upstream
        self._links.update((writer, upstream_writer))
        swallow = asyncio.Event()   # the client is gone: read the server's answer, drop it, then close
        try:
            await asyncio.gather(self._frontend(reader, upstream_writer, writer, swallow),
                                 _answers(upstream_reader, writer, swallow, self._held))
        finally:
            for end in (writer, upstream_writer):
                self._links.discard(end)
                end.transport.abort()

    async def _frontend(self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter,
                        client: asyncio.StreamWriter, swallow: asyncio.Event) -> None:
        """Client to server, message by message, watching for the transaction to break."""
        statements: dict[bytes, str] = {}
        marked = False
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:                                   # startup: length-prefixed, no type byte
                header = await reader.readexactly(8)
                length, code = struct.unpack("!ii", header)
                upstream.write(header + await reader.readexactly(length - 8))
                if code not in (SSL_REQUEST, GSS_REQUEST):
                    break
            while True:
                kind = await reader.readexactly(1)
                size = await reader.readexactly(4)
                body = await reader.readexactly(struct.unpack("!i", size)[0] - 4)
                if kind == b"P":                          # Parse: name, query
                    name, parsed = body.split(b"\0", 2)[:2]
                    statements[name] = parsed.decode(errors="replace")
                elif kind == b"B":                        # Bind: portal, statement
                    statement = body.split(b"\0", 2)[1]
                    marks = self._lose_after
                    marked = marked or (marks is not None and marks(statements.get(statement, "")))
                elif kind == b"Q":
                    query = body.rstrip(b"\0").decode(errors="replace").strip().rstrip(";").upper()
                    if query == "COMMIT" and marked and self._lose_after is not None:
                        self._lose_after = None
                        self.lost_acks += 1
                        swallow.set()                     # before the server can answer
                        client.transport.abort()
                        upstream.write(kind + size + body)
                        await upstream.drain()
                        return
                    if query.startswith(("BEGIN", "COMMIT", "ROLLBACK")):
                        marked = False
                await self._held(answer=False)
                upstream.write(kind + size + body)
                await upstream.drain()
        if not swallow.is_set():
            upstream.transport.abort()


async def _answers(reader: asyncio.StreamReader, client: asyncio.StreamWriter,
                   swallow: asyncio.Event, held: Callable[[bool], Awaitable[None]]) -> None:
    """Server to client; once `swallow` is set, the server's next answer (the COMMIT's) is read and
    dropped, and the connection closed: the commit happened, its acknowledgment is lost."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            if swallow.is_set():
                break
            await held(True)
            client.write(data)
            await client.drain()
    client.transport.abort()
