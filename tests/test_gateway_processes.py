"""Gateway processes on one box: several share a port when configured (SO_REUSEPORT), and a
second one on a taken port fails at start when not. Real processes, real PostgreSQL and Kafka."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.v1 import admission_pb2, admission_pb2_grpc
from tests.support import REPO_ROOT
from tests.support.ledger_factories import add_model, add_tenant
from tests.support.replica_proc import free_ports
from tests.support.routing_stack import MODEL, TOKENIZER

pytest_plugins = ["tests.support.db"]
pytestmark = pytest.mark.integration

READY = "gateway (admission, runs, usage) listening on"
ADMITTED = "admitted run"


class Gateway:
    def __init__(self, dsn: str, address: str, reuse_port: bool, log_path: Path) -> None:
        # The HTTP edge off: its own port is not what these tests share (and one box has one 8080).
        env = {**os.environ, "SLUICE_DATABASE__DSN": dsn, "PYTHONPATH": str(REPO_ROOT),
               "SLUICE_GATEWAY__REUSE_PORT": "true" if reuse_port else "false",
               "SLUICE_HTTP__ENABLED": "false"}
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
    # A new channel is a new connection; the kernel hashes each to one of the listeners.
    for index in range(24):
        async with grpc.aio.insecure_channel(address) as channel:
            request = admission_pb2.SubmitRequest(model=MODEL.alias, input=b"hello there",
                                                  max_output_tokens=4, request_key=f"k{index}")
            await admission_pb2_grpc.AdmissionStub(channel).Submit(
                request, metadata=(("x-api-key", tenant.api_key),))
    served = [gateway.log().count(ADMITTED) for gateway in gateways]
    assert sum(served) == 24 and min(served) > 0, served


async def test_without_reuse_port_a_second_gateway_on_a_taken_port_fails_to_start(
        database_dsn: str, gateways: list[Gateway], tmp_path: Path):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    gateways.append(Gateway(database_dsn, address, False, tmp_path / "first.log"))
    assert gateways[0].wait()
    gateways.append(Gateway(database_dsn, address, False, tmp_path / "second.log"))
    assert not gateways[1].wait()
    assert f"cannot listen on {address}" in gateways[1].log()
