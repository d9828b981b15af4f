"""Gateway processes on one box: several share a port when configured (SO_REUSEPORT), and a
second one on a taken port fails at start when not. Real processes, real PostgreSQL and Kafka."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc.aio
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner
from sluice.ledger.models import Run
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import load_settings
from sluice.v1 import admission_pb2, admission_pb2_grpc
from tests.support import REPO_ROOT
from tests.support.ledger_factories import add_model, add_tenant
from tests.support.replica_proc import free_ports
from tests.support.routing_stack import MODEL, TOKENIZER

pytest_plugins = ["tests.support.db"]
pytestmark = pytest.mark.integration

READY = "gateway (admission, runs, usage) listening on"
ADMITTED = "admitted run"
BUDGET = 3_000   # tokens: 24 small submits fit (prompt + cap 4 each), a cap of the whole budget never does


class Gateway:
    def __init__(self, dsn: str, address: str, reuse_port: bool, log_path: Path,
                 extra_env: Mapping[str, str] | None = None) -> None:
        # The HTTP edge off: its own port is not what these tests share (and one box has one 8080).
        env = {**os.environ, "SLUICE_DATABASE__DSN": dsn, "PYTHONPATH": str(REPO_ROOT),
               "SLUICE_GATEWAY__REUSE_PORT": "true" if reuse_port else "false",
               "SLUICE_HTTP__ENABLED": "false", "SLUICE_GATEWAY__METRICS_PORT": "0", **(extra_env or {})}
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sluice.services.main", "--role", "gateway", "--listen", address],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float = 60.0) -> bool:
        """True once serving; False if the process exited first."""
        deadline = time.monotonic() + timeout_s
        while READY not in self.log():
            if self.process.poll() is not None:
                return False
            assert time.monotonic() < deadline, f"gateway not ready:\n{self.log()}"
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for gateway in started:
        gateway.stop()


async def submit_many(address: str, api_key: str, count: int, max_output_tokens: int = 4,
                      key_prefix: str = "") -> None:
    # A new channel is a new connection; the kernel hashes each to one of the listeners.
    for index in range(count):
        async with grpc.aio.insecure_channel(address) as channel:
            request = admission_pb2.SubmitRequest(model=MODEL.alias, input=b"hello there",
                                                  max_output_tokens=max_output_tokens,
                                                  request_key=f"{key_prefix}k{index}")
            await admission_pb2_grpc.AdmissionStub(channel).Submit(
                request, metadata=(("x-api-key", api_key),))


async def test_two_gateway_processes_share_one_port_and_both_serve(
        database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession], gateways: list[Gateway],
        tmp_path: Path):
    async with sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, MODEL)
        tenant = await add_tenant(session, "acme")
    address = f"127.0.0.1:{free_ports(1)[0]}"
    for index in range(2):
        gateways.append(Gateway(database_dsn, address, True, tmp_path / f"gateway-{index}.log"))
    assert all(gateway.wait() for gateway in gateways)
    await submit_many(address, tenant.api_key, 24)
    served = [gateway.log().count(ADMITTED) for gateway in gateways]
    assert sum(served) == 24 and min(served) > 0, served


def scrape(port: int) -> dict[str, float]:
    """The samples of http://127.0.0.1:port/metrics, by name and labels as written."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_two_gateway_processes_in_multiprocess_mode_serve_the_sum_of_their_metrics(
        database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession], gateways: list[Gateway],
        tmp_path: Path):
    """Both processes count; whichever serves the metrics port serves both processes' numbers."""
    async with sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, MODEL)
        tenant = await add_tenant(session, "acme", token_budget=BUDGET)
    multiproc_dir = tmp_path / "metrics"
    multiproc_dir.mkdir()
    address, metrics_port = (f"127.0.0.1:{port}" if index == 0 else port
                             for index, port in enumerate(free_ports(2)))
    env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir), "SLUICE_GATEWAY__METRICS_PORT": str(metrics_port)}
    for index in range(2):
        gateways.append(Gateway(database_dsn, str(address), True, tmp_path / f"gateway-{index}.log", env))
    assert all(gateway.wait() for gateway in gateways)
    await submit_many(str(address), tenant.api_key, 24)
    # And two refusals: a cap larger than the budget left can never fit.
    await submit_refused(str(address), tenant.api_key, 2)
    served = [gateway.log().count(ADMITTED) for gateway in gateways]
    assert sum(served) == 24 and min(served) > 0, served       # both processes admitted some
    samples = scrape(int(metrics_port))
    assert samples['sluice_submit_seconds_count{code="OK"}'] == 24
    assert samples['sluice_submit_refusals_total{code="RESOURCE_EXHAUSTED",reason="BUDGET_EXCEEDED"}'] == 2
    # Budget left after the 24 reservations of prompt + cap (the last one any process made).
    prompt = await prompt_tokens(sessionmaker)
    assert samples['sluice_budget_remaining{kind="tokens",tenant="acme"}'] == BUDGET - 24 * (prompt + 4)


async def submit_refused(address: str, api_key: str, count: int) -> None:
    for index in range(count):
        async with grpc.aio.insecure_channel(address) as channel:
            request = admission_pb2.SubmitRequest(model=MODEL.alias, input=b"hello there",
                                                  max_output_tokens=BUDGET,
                                                  request_key=f"big{index}")
            try:
                await admission_pb2_grpc.AdmissionStub(channel).Submit(
                    request, metadata=(("x-api-key", api_key),))
            except grpc.aio.AioRpcError as refused:
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
            else:
                raise AssertionError("a submit over the budget was admitted")


async def prompt_tokens(sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    async with sessionmaker() as session:
        return int(await session.scalar(select(Run.input_tokens).limit(1)))


async def test_without_reuse_port_a_second_gateway_on_a_taken_port_fails_to_start(
        database_dsn: str, gateways: list[Gateway], tmp_path: Path):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    gateways.append(Gateway(database_dsn, address, False, tmp_path / "first.log"))
    assert gateways[0].wait()
    gateways.append(Gateway(database_dsn, address, False, tmp_path / "second.log"))
    assert not gateways[1].wait()
    assert f"cannot listen on {address}" in gateways[1].log()


async def test_each_gateway_process_admits_runs_whose_events_land_on_its_own_partitions(
        database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession], gateways: list[Gateway],
        tmp_path: Path):
    """[gateway].event_partitions: the run ids a gateway draws key its runs' events onto its own
    partitions (by the producer's default partitioner), so that its live tail reads only those."""
    async with sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, MODEL)
        tenant = await add_tenant(session, "acme")
    bootstrap, partitions = load_settings().kafka.bootstrap, 4
    topic = f"sluice.test-gateway-home-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
        homes = ([2], [0, 3])
        addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
        for index, (address, home) in enumerate(zip(addresses, homes, strict=True)):
            gateways.append(Gateway(database_dsn, address, False, tmp_path / f"gateway-{index}.log",
                                    {"SLUICE_KAFKA__EVENTS_TOPIC": topic,
                                     "SLUICE_GATEWAY__EVENT_PARTITIONS": json.dumps(home)}))
        assert all(gateway.wait() for gateway in gateways)
        every = list(range(partitions))
        # Enough runs that a gateway with two homes puts all of them on one by chance only once in
        # 2**(runs-1) (12 runs did it once in 2,048: a CI run failed on it).
        runs = 40
        for address, home, gateway in zip(addresses, homes, gateways, strict=True):
            await submit_many(address, tenant.api_key, runs, key_prefix=address)
            run_ids = re.findall(r"admitted run ([0-9a-f-]{36})", gateway.log())
            assert len(run_ids) == runs
            landed = {DefaultPartitioner()(run_id.encode(), every, every) for run_id in run_ids}
            assert landed <= set(home) and (len(home) == 1 or len(landed) > 1), (landed, home)
    finally:
        await admin.delete_topics([topic])
        await admin.close()
