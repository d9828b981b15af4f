"""Every public RPC served in-process on one port, called with raw bytes from a worker thread.

The fuzz tests (tests/test_fuzz_rpcs.py) draw requests with hypothesis, which runs synchronous
functions; the server lives on the test's event loop, so the tests call it from a worker thread
through a plain (synchronous) gRPC channel and read the ledger back through
`run_coroutine_threadsafe`. Bodies go out as raw bytes (no serializer), so a test can send
anything, including bodies that are not protobuf at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from sluice.ledger.models import Budget, Run, UsageEntry
from sluice.services.admission import add_admission_servicer
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.servicer import add_routing_servicer
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice.services.runs import add_runs_servicer
from sluice.services.usage import add_usage_servicer
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings
from sluice.eventlog.kafka import KafkaEventLog

# The statuses DESIGN.md "Errors" documents (and FAILED_PRECONDITION: cancelling a finished run).
# UNKNOWN and INTERNAL mean an unmapped failure; CANCELLED, ABORTED and the rest are never ours.
DOCUMENTED = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
})

UNARY = {
    "/sluice.v1.Admission/Submit", "/sluice.v1.Runs/GetRun", "/sluice.v1.Runs/Cancel",
    "/sluice.v1.UsageService/GetUsage", "/sluice.v1.Routing/ListReplicas",
    "/sluice.v1.Routing/UpsertReplica", "/sluice.v1.Routing/RemoveReplica", "/sluice.v1.Routing/Explain",
}
STREAMING = {"/sluice.v1.Runs/Stream"}
STREAM_WAIT_S = 0.5   # a Stream of a run that never starts would follow it forever: cut it here


@dataclass(frozen=True, slots=True)
class LedgerCounts:
    """What a refused call must leave unchanged."""

    runs: int
    usage_entries: int
    reserved_tokens: int
    used_tokens: int


class LogRecorder(logging.Handler):
    """Every record at ERROR or above, and every record carrying a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@dataclass(slots=True)
class FuzzTarget:
    address: str
    loop: asyncio.AbstractEventLoop
    sessionmaker: async_sessionmaker[AsyncSession]
    log: LogRecorder
    channel: grpc.Channel = field(init=False)
    calls: int = 0

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)

    def call(self, method: str, body: bytes, metadata: Sequence[tuple[str, str]] = ()) -> grpc.StatusCode:
        """The status of one call (from a worker thread); a Stream is read until it ends or for
        STREAM_WAIT_S, whichever comes first (DEADLINE_EXCEEDED then is the client's own cut)."""
        self.calls += 1
        try:
            if method in STREAMING:
                for _ in self.channel.unary_stream(method)(body, metadata=metadata, timeout=STREAM_WAIT_S):
                    pass
            else:
                self.channel.unary_unary(method)(body, metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def counts(self) -> LedgerCounts:
        return asyncio.run_coroutine_threadsafe(self._counts(), self.loop).result(timeout=10)

    async def _counts(self) -> LedgerCounts:
        async with self.sessionmaker() as session:
            runs = await session.scalar(select(func.count()).select_from(Run))
            entries = await session.scalar(select(func.count()).select_from(UsageEntry))
            reserved, used = (await session.execute(
                select(func.coalesce(func.sum(Budget.reserved_tokens), 0),
                       func.coalesce(func.sum(Budget.used_tokens), 0)))).one()
        return LedgerCounts(int(runs or 0), int(entries or 0), int(reserved), int(used))


@contextlib.asynccontextmanager
async def serve_everything(sessionmaker: async_sessionmaker[AsyncSession],
                           config: Settings) -> AsyncIterator[FuzzTarget]:
    """Admission, Runs, UsageService and Routing on one free port, as the gateway and the routing
    API serve them (the routing worker is built, not started: Routing answers from its registry)."""
    events = KafkaEventLog.from_config(config)
    await events.start()
    worker = RoutingWorker(WorkerSettings.from_config(config, new_owner_id("fuzz")), sessionmaker, events,
                           policy_from_config(config), registry_from_config(config),
                           dsn=config.database.url)
    server = grpc.aio.server()
    admission = add_admission_servicer(server, sessionmaker, config)
    runs = add_runs_servicer(server, sessionmaker, config, events)
    add_usage_servicer(server, sessionmaker, config)
    add_routing_servicer(server, worker)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    recorder = LogRecorder()
    logging.getLogger().addHandler(recorder)
    target = FuzzTarget(f"127.0.0.1:{port}", asyncio.get_running_loop(), sessionmaker, recorder)
    try:
        yield target
    finally:
        logging.getLogger().removeHandler(recorder)
        target.channel.close()
        await server.stop(None)
        await admission.close()
        await runs.close()
        await events.close()
