"""A TCP proxy a test can cut: stands between a client and a real server (PostgreSQL) to make an
outage of a chosen length without touching the shared server.

    proxy = await TcpProxy.start("127.0.0.1", 54329)   # clients connect to proxy.port
    await proxy.cut(0.8)    # every connection reset, new ones refused, for 0.8 s
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class TcpProxy:
    target_host: str
    target_port: int
    server: asyncio.Server | None = None
    port: int = 0
    down: bool = False
    cuts: int = 0
    _links: set[asyncio.StreamWriter] = field(default_factory=set)

    @classmethod
    async def start(cls, target_host: str, target_port: int) -> TcpProxy:
        proxy = cls(target_host, target_port)
        proxy.server = await asyncio.start_server(proxy._accept, "127.0.0.1", 0)
        proxy.port = proxy.server.sockets[0].getsockname()[1]
        return proxy

    async def cut(self, seconds: float) -> None:
        """Reset every open connection and refuse new ones for `seconds`."""
        self.down = True
        self.cuts += 1
        for writer in list(self._links):
            writer.transport.abort()
        await asyncio.sleep(seconds)
        self.down = False

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self._links):
            writer.transport.abort()

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
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for end in (writer, upstream_writer):
                self._links.discard(end)
                end.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()
