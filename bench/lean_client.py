"""The platform's Submit and Stream called through the lean HTTP/2 gRPC client the routing worker and
the bench's direct calls use for replicas (services/replica_conn.py), instead of grpc.aio.

Why the TTFT phase needs it: "TTFT added over the direct Triton call" compares two clients on one
2-core box. The direct call goes through replica_conn (one parse pass per socket read, on the event
loop); grpc.aio hands each message from gRPC core's threads to the event loop (a thread hop, a wake-up
of the loop) and spent ~0.7 ms of this box's CPU per Submit (bench_platform's submit phase) that the
platform's processes then wait for. With the same client on both sides the difference is the
platform's; bench_platform prints the grpc.aio figures beside it (what a caller using the SDK's
transport on the same box sees).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence

from sluice.services import replica_conn

from sluice.v1 import admission_pb2, runs_pb2

SUBMIT = "/sluice.v1.Admission/Submit"
STREAM = "/sluice.v1.Runs/Stream"


class CallFailed(Exception):
    """A call ended with a gRPC status other than OK."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class _Answer:
    """A unary call's sink: its one message, then its status."""

    def __init__(self) -> None:
        self.body = b""
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def message(self, body: bytes) -> None:
        self.body = body

    def closed(self, code: str | None, details: str) -> None:
        if not self.done.done():
            if code is None:
                self.done.set_result(self.body)
            else:
                self.done.set_exception(CallFailed(code, details))


class _Messages:
    """A server-streaming call's sink: messages as they come, then the end."""

    def __init__(self) -> None:
        self.items: deque[bytes] = deque()
        self.ended: tuple[str | None, str] | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def message(self, body: bytes) -> None:
        self.items.append(body)
        self._wake()

    def closed(self, code: str | None, details: str) -> None:
        self.ended = (code, details)
        self._wake()

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class LeanClient:
    """One HTTP/2 connection per gateway (plaintext), made on first use; calls carry an API key."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self._connections: dict[int, replica_conn.ReplicaConnection] = {}

    async def _connection(self, gateway: int) -> replica_conn.ReplicaConnection:
        connection = self._connections.get(gateway)
        if connection is None or not connection.usable:
            connection = self._connections[gateway] = await replica_conn.connect(self.addresses[gateway])
        return connection

    async def submit(self, gateway: int, key: str, request: admission_pb2.SubmitRequest) -> \
            admission_pb2.SubmitResponse:
        connection = await self._connection(gateway)
        answer = _Answer()
        stream_id = connection.start(SUBMIT, answer, (("x-api-key", key),))
        await connection.send(stream_id, request.SerializeToString(), last=True)
        return admission_pb2.SubmitResponse.FromString(await answer.done)

    async def stream(self, gateway: int, key: str, request: runs_pb2.StreamRequest) -> \
            AsyncIterator[runs_pb2.RunEvent]:
        connection = await self._connection(gateway)
        messages = _Messages()
        stream_id = connection.start(STREAM, messages, (("x-api-key", key),))
        ended = False
        try:
            await connection.send(stream_id, request.SerializeToString(), last=True)
            while True:
                while messages.items:
                    yield runs_pb2.RunEvent.FromString(messages.items.popleft())
                if messages.ended is not None:
                    ended = True
                    code, details = messages.ended
                    if code is not None:
                        raise CallFailed(code, details)
                    return
                await messages.wait()
        finally:
            if not ended:
                connection.cancel(stream_id)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
