"""The platform under bench_platform: its processes and the CPU each component spends.

    create_database / drop_database   a throwaway, migrated ledger with the tiny-chat model
                                      and N tenants (huge budgets, no limits)
    PlatformStack                     two simple-engine replicas, gateway processes, routing
                                      worker processes, on a private Kafka topic
    CpuMeter                          CPU-seconds per component read from /proc: each process
                                      group we started, the PostgreSQL backends serving our
                                      database (found in pg_stat_activity), the Kafka JVM

CPU is read as utime + stime from /proc/PID/stat, so a busy shared box slows the
bench down but does not inflate the figures. The broker and the PostgreSQL
server are shared with whatever else runs on the machine: backends are counted
only when connected to the bench database, and the broker's whole-JVM figure is
reported with its background rate measured while our stack is idle.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sluice.ledger.db import configured_dsn, make_engine, make_sessionmaker
from sluice.ledger.seed import TINY_CHAT, TenantSeed, ensure_tenant, upsert_model

from bench.bench_replica import (
    free_ports,
    group_cpu_seconds,
    sessions_cpu_seconds,
    start_replica,
    stop_replica,
)
from bench.bench_submit import _admin, _migrate, _url
from sluice.config import load_settings

REPO_ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
POOL = TINY_CHAT.worker_pool
GATEWAY_READY = "gateway (admission, runs, usage)"
ROUTING_READY = "routing worker"
KAFKA_MAIN_CLASS = b"kafka.Kafka"
BACKENDS_OF_DATABASE = "SELECT pid, query FROM pg_stat_activity WHERE datname = $1"


def tenant_key(index: int) -> str:
    return f"sk-benchplat-{index:04d}-0000000000000000000000000000"


# --- ledger and topic ---------------------------------------------------------------------------

async def create_database(tenants: int) -> tuple[str, str]:
    """(database name, asyncpg DSN) of a fresh migrated ledger seeded for the bench."""
    database = f"sluice_benchplat_{uuid.uuid4().hex[:10]}"
    await _admin(f'CREATE DATABASE "{database}"')
    dsn = _url(configured_dsn(), database)
    await asyncio.to_thread(_migrate, dsn)
    engine = make_engine(dsn, pool_size=1, max_overflow=0)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            await upsert_model(session, TINY_CHAT)
            month = dt.datetime.now(dt.UTC).date().replace(day=1)
            for index in range(tenants):
                seed = TenantSeed(f"benchplat-{index}", tenant_key(index), ("standard",),
                                  token_budget=10**13, cost_budget_micros=10**16)
                await ensure_tenant(session, seed, month)
    finally:
        await engine.dispose()
    return database, dsn


async def drop_database(database: str) -> None:
    await _admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


async def create_topic(bootstrap: str, partitions: int) -> str:
    """A private events topic, so the gateways' live tails see only the bench's records."""
    topic = f"sluice.bench-platform-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()
    return topic


async def delete_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
    await admin.start()
    try:
        with contextlib.suppress(Exception):
            await admin.delete_topics([topic])
    finally:
        await admin.close()


# --- processes ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Service:
    """One platform process, started in its own session so its whole group can be measured and stopped."""

    label: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, marker: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.log():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{self.label} did not start:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.process.pid)

    def stop(self, grace_s: float = 15.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def launch(label: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> Service:
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, *argv], cwd=REPO_ROOT, env=dict(env), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Service(label, process, log_path)


@dataclass(frozen=True, slots=True)
class StackSettings:
    token_delay_ms: float        # the simple engine's step: one token per live request per step
    gateways: int                # gateway processes
    routing_workers: int         # routing worker processes
    max_runs_per_worker: int     # so that the workers together can hold every concurrent stream
    max_backlog_per_pool: int    # high: the open-loop Submit phase must never be shed
    wire_replicas: bool = False  # bench/wire_replica.py, not Triton (the same bytes, a fraction of the CPU)


@dataclass(slots=True)
class PlatformStack:
    settings: StackSettings
    dsn: str
    topic: str
    log_dir: Path
    replicas: list[tuple[subprocess.Popen[bytes], str]] = field(default_factory=list)
    replica_tables: list[dict[str, object]] = field(default_factory=list)
    gateways: list[Service] = field(default_factory=list)
    gateway_addresses: list[str] = field(default_factory=list)
    workers: list[Service] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "SLUICE_DATABASE__DSN": self.dsn,
            "SLUICE_KAFKA__EVENTS_TOPIC": self.topic,
            "SLUICE_ROUTING__MAX_RUNS_PER_WORKER": json.dumps(self.settings.max_runs_per_worker),
            "SLUICE_ROUTING__METRICS_PORT": "0",
            "SLUICE_ADMISSION__MAX_BACKLOG_PER_POOL": json.dumps(self.settings.max_backlog_per_pool),
            # The bench drives the gRPC services; each gateway would otherwise bind the one HTTP port.
            "SLUICE_HTTP__ENABLED": "false",
            "SLUICE_REPLICAS": json.dumps(self.replica_tables),
            "PYTHONPATH": str(REPO_ROOT),
        })
        return env

    @property
    def replica_addresses(self) -> list[str]:
        return [address for _, address in self.replicas]

    def start(self) -> None:
        replica_settings = {"engine": "simple", "token_delay_ms": self.settings.token_delay_ms}
        for index in range(2):
            ports = free_ports(3)
            replica = start_replica(replica_settings, self.log_dir / f"replica-r{index}.log",
                                    name=f"r{index}", pool=POOL, ports=ports,
                                    module="bench.wire_replica" if self.settings.wire_replicas
                                    else "sluice.replica.serve")
            self.replicas.append(replica)
            self.replica_tables.append({"name": f"r{index}", "pool": POOL, "grpc_address": replica[1],
                                        "metrics_port": ports[2]})
        partitions = load_settings().kafka.partitions   # the bench topic's (bench_platform.create_topic)
        for index, port in enumerate(free_ports(self.settings.gateways)):
            address = f"127.0.0.1:{port}"
            argv = ["-m", "sluice.services.main", "--role", "gateway", "--listen", address]
            log_path = self.log_dir / f"gateway-{index}.log"
            # Each gateway its own partitions ([gateway].event_partitions), as a box's gateways should be
            # given: gateway i places its runs on partitions i, i + gateways, ... and reads only those.
            env = dict(self.env(), SLUICE_GATEWAY__EVENT_PARTITIONS=json.dumps(
                list(range(index % partitions, partitions, self.settings.gateways))))
            self.gateways.append(launch(f"gateway {index}", argv, env, log_path))
            self.gateway_addresses.append(address)
        for index in range(self.settings.routing_workers):
            self.workers.append(launch(f"routing worker {index}",
                                       ["-m", "sluice.services.routing", "--name", f"bench{index}"],
                                       self.env(), self.log_dir / f"routing-{index}.log"))
        for gateway in self.gateways:
            gateway.wait_ready(GATEWAY_READY)
        for worker in self.workers:
            worker.wait_ready(ROUTING_READY)

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()

    def stop(self) -> None:
        for service in [*self.workers, *self.gateways]:
            service.stop()
        for process, _ in self.replicas:
            stop_replica(process)


# --- CPU accounting -----------------------------------------------------------------------------

COMPONENTS = ("gateway", "routing", "postgres", "kafka")


def process_cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def kafka_pid(bootstrap: str | None = None) -> int | None:
    """The broker JVM serving `bootstrap` (default: the configured one): several may run on one box
    (a private broker on other ports, a CI dry run), and measuring the wrong one would be silent. A
    broker is matched by the listeners line of the properties file its command line names; with no
    match, the first broker found."""
    port = (bootstrap or load_settings().kafka.bootstrap).rsplit(":", 1)[-1]
    first: int | None = None
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                arguments = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if KAFKA_MAIN_CLASS not in arguments:
                    continue
                first = first or int(entry)
                properties = Path(arguments[arguments.index(KAFKA_MAIN_CLASS) + 1].decode()).read_text()
                if re.search(rf"^listeners=.*PLAINTEXT://[^,:]*:{port}\b", properties, re.MULTILINE):
                    return int(entry)
    return first


def statement_label(query: str) -> str:
    """A short, stable label for a statement: its first words, literals and parameters dropped."""
    words = re.sub(r"\$\d+|'[^']*'|\d+", "", " ".join(query.split())).split(" ")
    return " ".join(words[:6])[:60] or "(idle, no statement yet)"


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Cumulative CPU-seconds per component (and per PostgreSQL backend, which come and go)."""

    groups: dict[str, float]              # gateway, routing, kafka, replicas, client
    backends: dict[int, float]            # PostgreSQL backend pid -> its CPU so far

    def minus(self, before: CpuSample) -> dict[str, float]:
        spent = {name: self.groups[name] - before.groups.get(name, 0.0) for name in self.groups}
        spent["postgres"] = sum(self.backends_minus(before).values())
        return spent

    def backends_minus(self, before: CpuSample) -> dict[int, float]:
        # A backend born during the phase started from ~0; one that exited keeps its last reading.
        return {pid: cpu - before.backends.get(pid, 0.0) for pid, cpu in self.backends.items()}


class CpuMeter:
    """Samples every component's cumulative CPU; PostgreSQL backends are looked up by database."""

    def __init__(self, stack: PlatformStack, database: str) -> None:
        self.stack = stack
        self.database = database
        self.kafka = kafka_pid()
        self._backends: dict[int, float] = {}
        # pid -> its last statements as sampled (what the backend serves: `backend_roles`)
        self._queries: dict[int, collections.Counter[str]] = {}
        self._admin: asyncpg.Connection | None = None
        self._admin_lock = asyncio.Lock()        # the sampler and sample() share one connection
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # Connected to the server's own database, so this connection is not one of the bench's backends.
        self._admin = await asyncpg.connect(_url(configured_dsn(), "postgres", driver="postgresql"))
        self._sampler = asyncio.create_task(self._keep_sampling())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        if self._admin is not None:
            await self._admin.close()

    async def _keep_sampling(self) -> None:
        # Short-lived backends would otherwise take their CPU with them between two phase edges.
        while True:
            await self._read_backends()
            await asyncio.sleep(0.25)

    async def _read_backends(self) -> None:
        assert self._admin is not None
        async with self._admin_lock:
            rows = await self._admin.fetch(BACKENDS_OF_DATABASE, self.database)
        for row in rows:
            pid = int(row["pid"])
            cpu = process_cpu_seconds(pid)
            if cpu is not None:
                self._backends[pid] = cpu
            self._queries.setdefault(pid, collections.Counter())[statement_label(row["query"] or "")] += 1

    def backend_role(self, pid: int) -> str:
        """The statement this backend was most often found running (its role: a pool, a listener)."""
        seen = self._queries.get(pid)
        return seen.most_common(1)[0][0] if seen else "?"

    async def sample(self) -> CpuSample:
        await self._read_backends()
        return self.sample_now()

    def sample_now(self) -> CpuSample:
        """A sample from /proc alone, the PostgreSQL backends those last looked up (no query: for an
        instant inside a phase, e.g. a round's last first token)."""
        for pid in self._backends:
            cpu = process_cpu_seconds(pid)
            if cpu is not None:
                self._backends[pid] = cpu
        kafka = process_cpu_seconds(self.kafka) if self.kafka else None
        gateways = [g.process.pid for g in self.stack.gateways]
        workers = [w.process.pid for w in self.stack.workers]
        replicas = [p.pid for p, _ in self.stack.replicas]
        by_session = sessions_cpu_seconds({*gateways, *workers, *replicas})      # one pass over /proc
        groups = {
            "gateway": sum(by_session[pid] for pid in gateways),
            "routing": sum(by_session[pid] for pid in workers),
            "kafka": kafka or 0.0,
            "replicas": sum(by_session[pid] for pid in replicas),
            "client": time.process_time(),
        }
        return CpuSample(groups, dict(self._backends))
