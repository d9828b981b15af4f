"""What every Sluice gRPC server offers operators: grpc.health.v1 per service and server reflection.

Health follows the dependencies a server cannot work without: a `DependencyMonitor` probes
PostgreSQL (`SELECT 1`) and Kafka (a TCP connection to a bootstrap broker) every
`PROBE_INTERVAL_S`, each probe bounded by `PROBE_TIMEOUT_S`, so a lost dependency turns every
service of the server NOT_SERVING within about 1.5 s and back to SERVING once it answers again.

Both probes are paid per second by every process, busy or idle (issue 9), so each is one cheap look:
- PostgreSQL: one `SELECT 1` on the process's hot asyncpg pool (ledger/pg.py), one round trip (a
  SQLAlchemy checkout wrapped it in BEGIN and ROLLBACK: three statements, ~0.6 ms of client CPU),
  and none at all while the process's own statements on that pool got answers within the interval.
- Kafka: the probe keeps one idle TCP connection to a broker and asks only whether it is still
  open: a broker that stops or dies closes it (seen at the next probe, then a new connection is
  the probe until one succeeds). A connection is a broker's costliest request (~0.6 ms of its CPU
  here, and ~0.3 ms of ours); opening a fresh one every `KAFKA_RECONNECT_S` regardless still notices
  a broker that went silent without closing (a partition) within that.
Draining (SIGTERM) turns them NOT_SERVING for good before the server stops accepting calls, so a
load balancer stops sending new work first. The overall health ("") follows the same state.

Reflection lets grpcurl and other languages' tools list and call the services without .proto files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from sluice.ledger.pg import HotPool

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0
KAFKA_RECONNECT_S = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Probe = Callable[[], Awaitable[None]]   # returns when the dependency answers; raises otherwise


@dataclass(slots=True)
class Operability:
    """The health servicer of one server and the names it reports on."""

    servicer: health.aio.HealthServicer
    services: tuple[str, ...]
    draining: bool = False
    status: int | None = None        # last set (None: never); probes repeat it twice a second

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving and not self.draining else NOT_SERVING
        if status == self.status:
            return
        self.status = status
        for name in ("", *self.services):
            await self.servicer.set(name, status)

    async def drain(self) -> None:
        self.draining = True
        await self.set_serving(False)


def add_operability(server: grpc.aio.Server, services: Sequence[str]) -> Operability:
    """Register grpc.health.v1 (NOT_SERVING until the first probe passes) and reflection for
    `services` (full names, e.g. sluice.v1.Admission) on `server`."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    # The asyncio servicer, as enable_server_reflection picks for a grpc.aio.Server, named here so that
    # services/h2server.H2Server (not a grpc.aio.Server) gets it too.
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer((*services, health.SERVICE_NAME, reflection.SERVICE_NAME)), server)
    return Operability(servicer, tuple(services))


def postgres_probe(pool: HotPool, fresh_s: float = PROBE_INTERVAL_S) -> Probe:
    """`SELECT 1` on one of `pool`'s connections (a lost one is replaced by the pool's next acquire),
    unless the process's own statements on `pool` got an answer within `fresh_s`: a busy process then
    pays nothing for its health."""
    async def probe() -> None:
        if time.monotonic() - pool.answered_at < fresh_s:
            return
        async with pool.connection() as connection:
            await connection.fetchval("SELECT 1")
    return probe


class KafkaProbe:
    """Whether a bootstrap broker is there: an open connection held from the last successful probe,
    replaced every `reconnect_s` (see the module doc)."""

    def __init__(self, bootstrap: str, reconnect_s: float = KAFKA_RECONNECT_S) -> None:
        self.addresses = [entry.rsplit(":", 1) for entry in bootstrap.split(",") if entry]
        self.reconnect_s = reconnect_s
        self.connects = 0                # connections opened (tests count them)
        self._held: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._opened_at = 0.0

    async def __call__(self) -> None:
        if self._held is not None:
            reader, writer = self._held
            fresh = asyncio.get_running_loop().time() - self._opened_at < self.reconnect_s
            if fresh and not reader.at_eof() and reader.exception() is None and not writer.is_closing():
                return
            self._held = None
            writer.close()
        self._held = await self._connect()
        self._opened_at = asyncio.get_running_loop().time()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        last: OSError | None = None
        for host, port in self.addresses:
            try:
                opened = await asyncio.open_connection(host, int(port))
            except OSError as error:
                last = error
                continue
            self.connects += 1
            return opened
        raise last or OSError("no Kafka bootstrap address")

    def close(self) -> None:
        if self._held is not None:
            self._held[1].close()
            self._held = None


def kafka_probe(bootstrap: str, reconnect_s: float = KAFKA_RECONNECT_S) -> KafkaProbe:
    """A probe of any bootstrap broker (the producer and tails reconnect on their own; this only
    asks whether a broker is there at all)."""
    return KafkaProbe(bootstrap, reconnect_s)


class DependencyMonitor:
    """Probes the dependencies and sets every registered server's health from the result."""

    def __init__(self, probes: dict[str, Probe], interval_s: float = PROBE_INTERVAL_S,
                 timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.probes = probes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.servers: list[Operability] = []
        self.failing: tuple[str, ...] | None = None   # None: not probed yet
        self._task: asyncio.Task[None] | None = None

    async def _check(self, name: str, probe: Probe) -> str | None:
        try:
            await asyncio.wait_for(probe(), self.timeout_s)
        except Exception as error:   # any failure of a probe means "unreachable"
            return f"{name} ({type(error).__name__})"
        return None

    async def probe_once(self) -> None:
        results = await asyncio.gather(*(self._check(name, probe) for name, probe in self.probes.items()))
        failing = tuple(result for result in results if result is not None)
        if failing != self.failing:
            if failing:
                log.warning("dependencies unreachable: %s; health NOT_SERVING", ", ".join(failing))
            elif self.failing:
                log.info("dependencies reachable again; health SERVING")
        self.failing = failing
        for server in self.servers:
            await server.set_serving(not failing)

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for probe in self.probes.values():
            if isinstance(probe, KafkaProbe):
                probe.close()
