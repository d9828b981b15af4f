"""grpc.health.v1 and reflection on Sluice's gRPC servers.

Health follows the dependencies: a throwaway PostgreSQL (its own data dir and port, never the shared
one) is stopped under a served gateway and its health must read NOT_SERVING within 2 s, then
SERVING again once it is back; an unreachable Kafka and a drain read NOT_SERVING too. Reflection
is listed with grpcio-reflection's own client, without .proto files (what grpcurl does).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.pg import HotPool
from sluice.services.admission import add_admission_servicer
from sluice.services.main import GATEWAY_SERVICES
from sluice.services.operability import DependencyMonitor, add_operability, kafka_probe, postgres_probe

from sluice.config import load_settings
from sluice.eventlog.kafka import configured_bootstrap
from tests.support.replica_proc import free_ports

pytestmark = pytest.mark.integration

PG_BIN = Path("/usr/lib/postgresql/15/bin")
FLIP_WITHIN_S = 2.0


class ThrowawayPostgres:
    """A PostgreSQL 15 cluster of its own (trust auth, loopback, a free port), run as the
    `postgres` OS user as infra/postgres.sh does; stopped and removed after the test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.port = free_ports(1)[0]
        self.dsn = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True,
                       timeout=120)

    def init(self) -> None:
        self.root.mkdir(parents=True)
        shutil.chown(self.root, "postgres")
        for parent in self.root.parents:   # the postgres user must reach its data dir
            if parent != Path("/") and not (parent.stat().st_mode & 0o001):
                parent.chmod(parent.stat().st_mode | 0o001)
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", options, "-w", "start",
                          "-l", str(self.root / "log"))

    def stop(self) -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")


@pytest.fixture
def throwaway_postgres(tmp_path: Path) -> Iterator[ThrowawayPostgres]:
    if not (PG_BIN / "initdb").exists():
        pytest.skip("PostgreSQL 15 server binaries missing")
    cluster = ThrowawayPostgres(tmp_path / "pg")
    cluster.init()
    cluster.start()
    try:
        yield cluster
    finally:
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(cluster.data),
                        "-m", "immediate", "stop"], capture_output=True, timeout=60)


async def status_of(channel: grpc.aio.Channel, service: str) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=1.0)
    return int(response.status)


async def seconds_until(channel: grpc.aio.Channel, service: str, wanted: int, limit_s: float) -> float:
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < limit_s:
        if await status_of(channel, service) == wanted:
            return elapsed
        await asyncio.sleep(0.05)
    raise AssertionError(f"{service or 'overall'} not {wanted} within {limit_s} s")


async def test_health_follows_postgresql_stopping_and_returning(throwaway_postgres: ThrowawayPostgres):
    engine = make_engine(throwaway_postgres.dsn)
    hot = HotPool(throwaway_postgres.dsn)
    server = grpc.aio.server()
    admission = add_admission_servicer(server, make_sessionmaker(engine), load_settings(), hot=hot)
    monitor = DependencyMonitor({"postgresql": postgres_probe(hot),
                                 "kafka": kafka_probe(configured_bootstrap(load_settings().kafka))})
    operability = add_operability(server, GATEWAY_SERVICES)
    monitor.servers.append(operability)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await monitor.probe_once()
        monitor.start()
        for service in ("", *GATEWAY_SERVICES):
            assert await status_of(channel, service) == health_pb2.HealthCheckResponse.SERVING
        await asyncio.to_thread(throwaway_postgres.stop)
        down_s = await seconds_until(channel, "sluice.v1.Admission",
                                     health_pb2.HealthCheckResponse.NOT_SERVING, FLIP_WITHIN_S)
        assert await status_of(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.to_thread(throwaway_postgres.start)
        up_s = await seconds_until(channel, "sluice.v1.Admission", health_pb2.HealthCheckResponse.SERVING,
                                   FLIP_WITHIN_S)
        print(f"health: NOT_SERVING {down_s:.2f} s after PostgreSQL stopped, SERVING {up_s:.2f} s after it"
              " was back")
        await monitor.stop()
        await operability.drain()
        assert await status_of(channel, "sluice.v1.Runs") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await monitor.stop()
        await channel.close()
        await server.stop(None)
        await admission.close()
        await hot.close()
        await engine.dispose()


async def test_an_unreachable_kafka_is_not_serving():
    monitor = DependencyMonitor({"kafka": kafka_probe(f"127.0.0.1:{free_ports(1)[0]}")})
    server = grpc.aio.server()
    monitor.servers.append(add_operability(server, GATEWAY_SERVICES))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await monitor.probe_once()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = await status_of(channel, "sluice.v1.UsageService")
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert monitor.failing and monitor.failing[0].startswith("kafka")
    finally:
        await server.stop(None)


async def test_the_postgresql_probe_asks_only_when_the_pool_has_not_had_an_answer_lately(database_dsn: str):
    """A busy process's own statements are its health: the probe sends SELECT 1 only when the pool's
    last answer is older than its freshness window."""
    pool = HotPool(database_dsn, size=1)            # one connection: its query log sees everything
    sent: list[str] = []
    try:
        async with pool.connection() as connection:
            connection.add_query_logger(lambda query: sent.append(query.query))
        probe = postgres_probe(pool, fresh_s=0.3)
        await probe()
        assert sent == []                           # answered a moment ago (the logger's own acquire)
        await asyncio.sleep(0.35)
        await probe()
        assert sent == ["SELECT 1"]
        await probe()
        assert sent == ["SELECT 1"]                 # the probe's own answer counts too
    finally:
        await pool.close()


async def test_the_postgresql_probe_fails_when_nobody_answers():
    pool = HotPool(f"postgresql+asyncpg://nobody@127.0.0.1:{free_ports(1)[0]}/none")
    monitor = DependencyMonitor({"postgresql": postgres_probe(pool)})
    try:
        await monitor.probe_once()
        assert monitor.failing and monitor.failing[0].startswith("postgresql")
    finally:
        await pool.close()


async def test_the_kafka_probe_holds_one_connection_while_the_broker_keeps_it_open():
    """Six probes of the real broker open one connection (each used to open its own)."""
    probe = kafka_probe(configured_bootstrap(load_settings().kafka))
    try:
        for _ in range(6):
            await probe()
        assert probe.connects == 1
    finally:
        probe.close()


async def test_the_kafka_probe_fails_once_the_broker_closes_its_connection_and_is_gone():
    """A stand-in broker (a TCP listener) that closes its connections and stops listening, as a broker
    going down does: the next probe sees the held connection closed and fails to open another."""
    accepted: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    monitor = DependencyMonitor({"kafka": kafka_probe(f"127.0.0.1:{port}")})
    await monitor.probe_once()
    await monitor.probe_once()
    assert monitor.failing == ()
    listener.close()
    await listener.wait_closed()
    for writer in accepted:
        writer.close()
    await asyncio.sleep(0.1)             # the FIN reaches the probe's connection
    await monitor.probe_once()
    assert monitor.failing and monitor.failing[0].startswith("kafka")
    await monitor.stop()


async def test_the_kafka_probe_opens_a_fresh_connection_every_reconnect_interval():
    """A broker silent behind a partition keeps the held connection open: a fresh one every
    reconnect_s is what notices it."""
    probe = kafka_probe(configured_bootstrap(load_settings().kafka), reconnect_s=0.2)
    try:
        await probe()
        await probe()
        await asyncio.sleep(0.25)
        await probe()
        assert probe.connects == 2
    finally:
        probe.close()


def reflected(address: str) -> tuple[list[str], list[str]]:
    """What grpcurl's `list` and `describe sluice.v1.Admission` would show (a blocking client)."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        found = database.FindFileContainingSymbol("sluice.v1.Admission")
        methods = [method.name for service in found.service if service.name == "Admission"
                   for method in service.method]
        return services, methods


async def test_reflection_lists_every_service_without_proto_files():
    server = grpc.aio.server()
    add_operability(server, GATEWAY_SERVICES)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        services, methods = await asyncio.to_thread(reflected, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)
    assert set(GATEWAY_SERVICES) <= set(services)
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    assert "Submit" in methods
