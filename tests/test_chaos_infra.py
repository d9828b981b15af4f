"""The fault suite's Kafka faults, each on throwaway brokers of their own (never the shared broker on
:19092): the single broker killed and restarted under load, one broker of a three-node cluster
killed under load. (The PostgreSQL restart is in tests/test_chaos_postgres.py.)

Part of `make chaos` (SLUICE_CHAOS=1); tests/support/chaos.py holds the invariants and the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sluice.ledger.models import RunStatus
from sluice_client.sdk import SluiceClient

from tests.support import REPO_ROOT
from tests.support.chaos import ChaosResult, Load, conclude, expect_no_healthy_run_interrupted, full_only
from tests.support.replica_proc import free_ports
from tests.support.routing_stack import Stack

pytestmark = [pytest.mark.integration, full_only]

PROMPT = "Explain how a canal lock raises a boat"


def infra(script: str, command: str, env: dict[str, str], *args: str, timeout_s: float = 180) -> None:
    subprocess.run([str(REPO_ROOT / "infra" / script), command, *args], cwd=REPO_ROOT,
                   env={**os.environ, **env}, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)


def throwaway_dir(name: str) -> str:
    """A data dir of its own, outside pytest's basetemp: concurrent pytest sessions of the same
    user prune each other's basetemps, which would pull a data dir from under a running server."""
    return tempfile.mkdtemp(prefix=f"sluice-{name}-")


def kill_single_broker(env: dict[str, str]) -> None:
    """SIGKILL the throwaway broker (infra/kafka.sh keeps its pid under <data_dir>/kafka)."""
    pid_file = Path(env["SLUICE_PATHS__DATA_DIR"]) / "kafka" / "kafka.pid"
    os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)


@contextlib.contextmanager
def single_broker(name: str, **extra_env: str) -> Iterator[dict[str, str]]:
    """A single Kafka broker of its own (ports, data dir) started by infra/kafka.sh; yields its
    SLUICE_* environment (with `extra_env`, e.g. KAFKA_REQUEST_LOG)."""
    broker, controller = free_ports(2)
    env = {"SLUICE_PATHS__DATA_DIR": throwaway_dir(name), "SLUICE_KAFKA__BOOTSTRAP": f"127.0.0.1:{broker}",
           "SLUICE_KAFKA__CONTROLLER_PORT": str(controller), **extra_env}
    infra("kafka.sh", "start", env)
    try:
        infra("kafka.sh", "wait", env)
        yield env
    finally:
        infra("kafka.sh", "stop", env)
        shutil.rmtree(env["SLUICE_PATHS__DATA_DIR"], ignore_errors=True)


@pytest.fixture(scope="module")
def throwaway_broker() -> Iterator[dict[str, str]]:
    with single_broker("chaos-kafka") as env:
        yield env


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[dict[str, str]]:
    """The three-node KRaft cluster of infra/kafka_cluster.sh, on ports and a data dir of its own."""
    ports = free_ports(6)
    env = {"SLUICE_PATHS__DATA_DIR": throwaway_dir("chaos-cluster"),
           "SLUICE_KAFKA__BROKERS": "3",
           "SLUICE_KAFKA__CLUSTER_BOOTSTRAP": ",".join(f"127.0.0.1:{p}" for p in ports[:3]),
           "SLUICE_KAFKA__CLUSTER_CONTROLLER_PORTS": ",".join(str(p) for p in ports[3:])}
    infra("kafka_cluster.sh", "start", env)
    try:
        infra("kafka_cluster.sh", "wait", env, timeout_s=300)
        yield env
    finally:
        infra("kafka_cluster.sh", "stop", env)
        shutil.rmtree(env["SLUICE_PATHS__DATA_DIR"], ignore_errors=True)


@pytest.fixture
def on_broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point the stack (built after this fixture) at the broker the test names."""
    env: dict[str, str] = request.getfixturevalue(request.param)
    for key, value in env.items():
        if key.startswith("SLUICE_KAFKA__"):
            monkeypatch.setenv(key, value)
    return env


async def _load_with_fault(stack: Stack, name: str, count: int, cap: int, fault_after_s: float,
                           fault: Callable[[], None], recover: Callable[[], None] | None,
                           recover_after_s: float = 0.0) -> ChaosResult:
    await stack.start_worker()
    started = time.monotonic()
    load = Load(stack)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        await load.submit(sdk, count, cap, PROMPT)
        await asyncio.sleep(fault_after_s)
        fault_at = time.monotonic()
        await asyncio.to_thread(fault)
        fault_s = time.monotonic() - fault_at
        if recover is not None:
            await asyncio.sleep(recover_after_s)
            await asyncio.to_thread(recover)
        result = await conclude(ChaosResult(name), load, started, stream_timeout_s=120,
                                terminal_timeout_s=60)
    result.note = (f"fault took {fault_s:.1f} s; INTERRUPTED {result.statuses[RunStatus.INTERRUPTED]}"
                   f" of {result.runs}")
    return result


@pytest.mark.parametrize("on_broker", ["throwaway_broker"], indirect=True)
async def test_the_single_broker_killed_and_restarted_under_load_loses_no_run_or_event(
        on_broker: dict[str, str], stack: Stack):
    result = await _load_with_fault(
        stack, "Kafka single broker SIGKILL + restart", 10, 150, 1.5, lambda: kill_single_broker(on_broker),
        lambda: infra("kafka.sh", "start", on_broker), recover_after_s=5.0)
    assert result.passed, "\n".join(result.violations[:10])


@pytest.mark.parametrize("on_broker", ["kafka_cluster"], indirect=True)
async def test_one_broker_of_three_killed_under_load_loses_no_run_or_event(
        on_broker: dict[str, str], stack: Stack):
    result = await _load_with_fault(
        stack, "Kafka 1 of 3 brokers SIGKILL", 20, 150, 1.5,
        lambda: infra("kafka_cluster.sh", "kill", on_broker, "2"),
        lambda: infra("kafka_cluster.sh", "start-node", on_broker, "2"), recover_after_s=3.0)
    assert result.passed, "\n".join(result.violations[:10])
    expect_no_healthy_run_interrupted(result)
    assert result.statuses == {RunStatus.COMPLETED: 20}, result.note
