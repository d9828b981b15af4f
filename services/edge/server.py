"""Serving the edge from the gateway process: uvicorn on the gateway's own event loop.

Why this stack: uvicorn with the httptools parser (llhttp, in C) and uvloop is the fastest
maintained ASGI server/parser/loop combination for CPython, and running it as a task on the
process's loop (the one grpc.aio, SQLAlchemy's asyncpg pool and the Kafka consumer already run on)
lets the edge call the same service objects in process: no second hop, no second pool.

uvicorn normally owns the process (signals, loop); here it is a guest: the gateway keeps its
signal handlers and stops the server by setting `should_exit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from sluice.services.edge.app import build_app
from sluice.services.edge.web import EdgeServices

log = logging.getLogger(__name__)


class _GuestServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield                        # the gateway process owns SIGTERM/SIGINT


class EdgeServer:
    def __init__(self, edge: EdgeServices) -> None:
        settings = edge.settings
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((settings.host, settings.port))
        except OSError as error:
            self._socket.close()
            raise SystemExit(f"HTTP edge cannot listen on {settings.host}:{settings.port}: {error}") from None
        self.port: int = self._socket.getsockname()[1]
        self.address = f"http://{settings.host}:{self.port}"
        config = uvicorn.Config(build_app(edge), http="httptools", loop="none", lifespan="off",
                                log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        self._server = _GuestServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                await self._task     # raises why it could not start
                raise RuntimeError("HTTP edge stopped while starting")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()
