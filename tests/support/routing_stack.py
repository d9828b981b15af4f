"""The whole run path on real servers, for the routing/runs/SDK tests.

    pytest_plugins = ["tests.support.db", "tests.support.routing_stack"]

- `replicas` (session): two real Triton replicas (`python -m sluice.replica.serve`) on free ports;
- `stack` (per test): a fresh migrated database with the tiny-chat model and two tenants,
  Admission + Runs + Usage served in-process on a free port, the real Kafka event log,
  and one in-process routing worker; `stack.start_worker_process()` launches more routing
  workers as separate processes (`python -m sluice.services.routing`) that a test may SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.models import Run
from sluice.ledger.seed import TINY_CHAT, read_chat_template
from sluice.services import replica_client
from sluice.services.admission import add_admission_servicer
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.servicer import add_routing_servicer
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice.services.runs import RunsService, add_runs_servicer
from sluice.services.usage import add_usage_servicer
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings, load_settings
from sluice.config.settings import env_overrides
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import routing_pb2_grpc, runs_pb2
from tests.support import REPO_ROOT
from tests.support.ledger_factories import ModelSpec, TenantHandle, add_model, add_tenant
from tests.support.replica_proc import ReplicaProcess, free_ports, kill_replica, start_replica, stop_replica
from tests.support.tcp_proxy import TcpProxy

TOKENIZER = "tiny-chat/tokenizer.json"
MODEL = ModelSpec(version="tiny-chat-v1", alias="chat", context_limit=4096,
                  chat_template=read_chat_template(TINY_CHAT.chat_template))
TOKEN_DELAY_MS = 20
# The simple engine at a fixed 20 ms per token: the routing tests reason about time
# (a cancel lands mid-stream, a run outlives a lease), so they pin a predictable replica.
REPLICA_SETTINGS = {"engine": "simple", "token_delay_ms": TOKEN_DELAY_MS}
TEST_LEASE_SECONDS = 3          # short, so a lost worker is noticed within a few seconds; not 2: on a
                                # loaded 2-core box an event loop can stall past 2 s and lose a live lease
WORKER_READY = "routing worker"
TEST_COALESCE_MS = 0


STREAM_TIMEOUT_S = 30.0


async def collect(stream: AsyncIterator[runs_pb2.RunEvent],
                  timeout_s: float = STREAM_TIMEOUT_S) -> list[runs_pb2.RunEvent]:
    """Every event of a stream. A stream that misses an event never ends, so the wait is bounded."""
    received: list[runs_pb2.RunEvent] = []

    async def read() -> None:
        async for event in stream:
            received.append(event)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"stream stalled after {[e.sequence for e in received]}") from None
    return received


async def stream_with_fault(stream: AsyncIterator[runs_pb2.RunEvent], after_events: int,
                            fault: Callable[[], Any]) -> tuple[list[runs_pb2.RunEvent], float]:
    """Read a whole stream, calling `fault` (in a thread: it may block) once `after_events` have
    arrived. Returns the events and the seconds from the fault to the stream's end."""
    events: list[runs_pb2.RunEvent] = []
    faulted_at = 0.0
    async for event in stream:
        events.append(event)
        if len(events) == after_events:
            await asyncio.to_thread(fault)
            faulted_at = time.monotonic()
    return events, time.monotonic() - faulted_at


def deltas_tokens(events: list[runs_pb2.RunEvent]) -> int:
    """Output tokens carried by the DELTA events among `events`."""
    return sum(len(e.token_ids) for e in events if e.type == runs_pb2.EVENT_TYPE_DELTA)


def replica_tables(replicas: list[ReplicaProcess]) -> list[dict[str, Any]]:
    return [{"name": r.name, "pool": MODEL.version, "grpc_address": r.grpc_address,
             "metrics_port": r.metrics_port} for r in replicas]


def test_config(database_dsn: str, replicas: list[ReplicaProcess]) -> Settings:
    # The run-path tests predict which replica takes a run, so they pin round_robin whatever
    # the shipped default is; prefix_aware is tested live in test_routing_live.py.
    # They reason in events too (drop after event 35, a cancel after the third): one event per replica
    # response (coalesce_ms 0) instead of the default windows, which test_routing_driver.py pins.
    return load_settings().updated(database={"dsn": database_dsn},
                                   routing={"lease_seconds": TEST_LEASE_SECONDS, "policy": "round_robin"},
                                   kafka={"coalesce_ms": TEST_COALESCE_MS},
                                   replicas=replica_tables(replicas))


def worker_env(config: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(env_overrides("database", {"dsn": config.database.dsn}))
    env.update(env_overrides("routing", {"lease_seconds": config.routing.lease_seconds,
                                         "policy": config.routing.policy}))
    env.update(env_overrides("kafka", {"coalesce_ms": config.kafka.coalesce_ms}))
    env["SLUICE_REPLICAS"] = json.dumps(config.replica_tables())
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


@dataclass(slots=True)
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to finish anything, as on a lost machine."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def launch_worker_process(config: Settings, log_dir: Path, name: str, profile_to: str | None = None,
                          timeout_s: float = 30.0) -> WorkerProcess:
    """A routing worker process; `profile_to` runs it under cProfile, stats written there on exit."""
    log_path = log_dir / f"routing-{name}-{uuid.uuid4().hex[:6]}.log"
    command = ["-m", "sluice.services.routing", "--name", name]
    if profile_to:   # CPU time, not wall time: a loaded box must not distort the profile
        command = ["-c", "import cProfile, sys, time; from sluice.services.routing.__main__ import main; "
                   "p = cProfile.Profile(time.process_time); p.runcall(main, ['--name', sys.argv[2]]); "
                   "p.dump_stats(sys.argv[1])", profile_to, name]
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, *command],
                                   cwd=REPO_ROOT, env=worker_env(config), stdout=log,
                                   stderr=subprocess.STDOUT)
    worker = WorkerProcess(name, process, log_path)
    started = time.monotonic()
    while WORKER_READY not in worker.log():
        if process.poll() is not None:
            raise RuntimeError(f"routing worker {name} exited {process.returncode}:\n{worker.log()}")
        if time.monotonic() - started > timeout_s:
            worker.kill()
            raise TimeoutError(f"routing worker {name} not ready:\n{worker.log()}")
        time.sleep(0.05)
    return worker


@pytest.fixture(scope="session")
def replica_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("stack-logs"))


@pytest.fixture(scope="session")
def replicas(replica_logs: Path) -> Iterator[list[ReplicaProcess]]:
    """Two replicas for the whole session (tests that kill one start their own)."""
    started: list[ReplicaProcess] = []
    try:
        for name in ("r0", "r1"):
            started.append(start_replica(name, replica_logs, REPLICA_SETTINGS))
        yield started
    finally:
        for replica in started:
            stop_replica(replica)


@dataclass(slots=True)
class RunsServer:
    address: str
    port: int
    server: grpc.aio.Server
    events: KafkaEventLog
    service: RunsService

    async def stop(self) -> None:
        """Stop at once: open streams break (clients see UNAVAILABLE or a reset)."""
        await self.server.stop(None)
        await self.service.close()
        await self.events.close()


@dataclass(slots=True)
class Stack:
    config: Settings
    sessionmaker: async_sessionmaker[AsyncSession]
    channel: grpc.aio.Channel
    address: str                      # Admission, Runs and Usage all served here
    events: KafkaEventLog
    tenant: TenantHandle
    other: TenantHandle               # a second tenant, for isolation checks
    log_dir: Path
    workers: list[RoutingWorker] = field(default_factory=list)
    processes: list[WorkerProcess] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _closers: list[Callable[[], Any]] = field(default_factory=list)
    _runs_servers: list[RunsServer] = field(default_factory=list)

    async def start_worker(self) -> RoutingWorker:
        """An in-process routing worker sharing this test's event loop."""
        settings = WorkerSettings.from_config(self.config, new_owner_id("test"))
        worker = RoutingWorker(settings, self.sessionmaker, self.events, policy_from_config(self.config),
                               registry_from_config(self.config), dsn=self.config.database.url)
        self.workers.append(worker)
        self._tasks.append(asyncio.create_task(worker.serve(drain_s=0.5)))
        return worker

    def start_worker_process(self, name: str) -> WorkerProcess:
        process = launch_worker_process(self.config, self.log_dir, name)
        self.processes.append(process)
        return process

    async def start_runs_server(self, port: int = 0) -> RunsServer:
        """Another Runs instance (own server, own event-log client) on `port` (0 = a free one)."""
        events = KafkaEventLog(self.config.kafka.bootstrap, self.events.topic)
        await events.start()
        server = grpc.aio.server()
        service = add_runs_servicer(server, self.sessionmaker, self.config, events)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        handle = RunsServer(f"127.0.0.1:{bound}", bound, server, events, service)
        self._runs_servers.append(handle)
        return handle

    async def publish_through(self, events: KafkaEventLog) -> None:
        """Workers started afterwards publish through `events` (started here, closed with the stack);
        Runs keeps reading through its own."""
        await events.start()
        self._closers.append(events.close)
        self.events = events

    async def use_topic(self, topic: str) -> None:
        """Publish and read this test's events on another topic (workers started afterwards)."""
        events = KafkaEventLog(self.config.kafka.bootstrap, topic)
        await events.start()
        self._closers.append(events.close)
        self.events = events
        self.config = self.config.updated(kafka={"events_topic": topic})

    async def run_row(self, run_id: str) -> Run:
        async with self.sessionmaker() as session:
            run = await session.get(Run, uuid.UUID(run_id))
            assert run is not None
            return run

    async def wait_for_status(self, run_id: str, statuses: set[str], timeout_s: float = 15.0) -> Run:
        deadline = time.monotonic() + timeout_s
        while True:
            run = await self.run_row(run_id)
            if run.status in statuses:
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} still {run.status} after {timeout_s}s, wanted {statuses}")
            await asyncio.sleep(0.05)

    async def wait_for_published(self, run_id: str, timeout_s: float = 10.0) -> Run:
        """The run once its terminal event's publication is recorded (a reader may see the
        event a moment before the publisher records that it did)."""
        deadline = time.monotonic() + timeout_s
        while not (run := await self.run_row(run_id)).terminal_published:
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id}: terminal event not recorded published in {timeout_s}s")
            await asyncio.sleep(0.02)
        return run

    async def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        for task in self._tasks:
            await task
        for process in self.processes:
            process.kill()
        for runs_server in self._runs_servers:
            await runs_server.stop()
        for server in self._servers:
            await server.stop(None)
        for close in self._closers:
            await close()


@contextlib.asynccontextmanager
async def routing_api(worker: RoutingWorker) -> AsyncIterator[routing_pb2_grpc.RoutingStub]:
    """The Routing API of `worker`, served on a free port for the block's length."""
    server = grpc.aio.server()
    add_routing_servicer(server, worker)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield routing_pb2_grpc.RoutingStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def open_stack(database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession],
                     replicas: list[ReplicaProcess], log_dir: Path) -> AsyncIterator[Stack]:
    """The stack over `replicas` (none: a test that brings its own, e.g. through the autoscaler)."""
    config = test_config(database_dsn, replicas)
    async with sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, MODEL)
        tenant = await add_tenant(session, "acme")
        other = await add_tenant(session, "globex")
    events = KafkaEventLog.from_config(config)
    await events.start()
    server = grpc.aio.server()
    admission = add_admission_servicer(server, sessionmaker, config)
    runs_service = add_runs_servicer(server, sessionmaker, config, events)
    add_usage_servicer(server, sessionmaker, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    built = Stack(config=config, sessionmaker=sessionmaker, channel=channel, address=address, events=events,
                  tenant=tenant, other=other, log_dir=log_dir)
    built._servers.append(server)
    built._closers.extend([admission.close, runs_service.close, events.close])
    try:
        yield built
    finally:
        await built.close()
        await channel.close()
        await replica_client.close_channels()


@contextlib.asynccontextmanager
async def proxied_worker(stack: Stack) -> AsyncIterator[tuple[TcpProxy, RoutingWorker]]:
    """A routing worker that reaches PostgreSQL only through a proxy: its pool, keeper, reaper, LISTENs."""
    proxy, proxied = await TcpProxy.before_database(stack.config.database.url)
    engine = make_engine(proxied)
    worker = RoutingWorker(WorkerSettings.from_config(stack.config, new_owner_id("stall")),
                           make_sessionmaker(engine), stack.events, policy_from_config(stack.config),
                           registry_from_config(stack.config), dsn=proxied)
    serving = asyncio.create_task(worker.serve(drain_s=0.5))
    try:
        yield proxy, worker
    finally:
        worker.stop()
        await serving
        await engine.dispose()
        await proxy.close()


@pytest.fixture
async def stack(database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession],
                replicas: list[ReplicaProcess], replica_logs: Path) -> AsyncIterator[Stack]:
    async with open_stack(database_dsn, sessionmaker, replicas, replica_logs) as built:
        yield built


__all__ = ["MODEL", "ReplicaProcess", "Stack", "free_ports", "kill_replica", "start_replica", "stop_replica"]
