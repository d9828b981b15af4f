"""Start and stop real replica processes (`python -m sluice.replica.serve`) on free ports.

Each replica runs in its own session (process group) so a test can kill it
together with the tritonserver it spawned, as a machine loss would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sluice.autoscaler.local import free_ports as free_ports  # re-exported: tests import it from here
from sluice.config import load_settings
from sluice.config.settings import env_overrides
from tests.support import REPO_ROOT

READY_MARKER = "ready model=tensorrt_llm"


@dataclass(frozen=True, slots=True)
class ReplicaProcess:
    name: str
    grpc_address: str
    http_port: int
    metrics_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def workspace(self) -> Path:
        """Where replica.serve keeps its pytriton workspace (a killed replica leaves it behind)."""
        port = self.grpc_address.rpartition(":")[2]
        return load_settings().data_dir() / "replicas" / f"{self.name}-{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def replica_env(name: str, grpc_port: int, http_port: int, metrics_port: int,
                replica_settings: Mapping[str, object]) -> dict[str, str]:
    env = dict(os.environ)
    env["SLUICE_REPLICAS"] = json.dumps([{
        "name": name, "pool": "tiny-chat-v1", "grpc_address": f"127.0.0.1:{grpc_port}",
        "http_port": http_port, "metrics_port": metrics_port,
    }])
    env.update(env_overrides("replica", replica_settings))
    return env


def launch_replica(name: str, log_dir: Path, replica_settings: Mapping[str, object] | None = None,
                   ports: tuple[int, int, int] | None = None,
                   extra_env: Mapping[str, str] | None = None) -> ReplicaProcess:
    """Spawn a replica without waiting for it (see wait_ready); `extra_env` adds SLUICE_* overrides."""
    grpc_port, http_port, metrics_port = ports or tuple(free_ports(3))
    log_path = log_dir / f"replica-{name}-{grpc_port}.log"
    env = replica_env(name, grpc_port, http_port, metrics_port, replica_settings or {})
    env.update(extra_env or {})
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.replica.serve", "--name", name],
            cwd=REPO_ROOT, env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return ReplicaProcess(name, f"127.0.0.1:{grpc_port}", http_port, metrics_port, process, log_path)


def wait_ready(replica: ReplicaProcess, timeout_s: float = 60.0) -> float:
    """Block until the replica printed its ready line; returns seconds waited. Raises if it exits."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if READY_MARKER in replica.log():
            return time.monotonic() - started
        if replica.process.poll() is not None:
            code = replica.process.returncode
            raise RuntimeError(f"replica {replica.name} exited {code}:\n{replica.log()}")
        time.sleep(0.1)
    raise TimeoutError(f"replica {replica.name} not ready after {timeout_s}s:\n{replica.log()[-4000:]}")


def start_replica(name: str, log_dir: Path, replica_settings: Mapping[str, object] | None = None,
                  timeout_s: float = 60.0, extra_env: Mapping[str, str] | None = None) -> ReplicaProcess:
    replica = launch_replica(name, log_dir, replica_settings, extra_env=extra_env)
    try:
        wait_ready(replica, timeout_s)
    except BaseException:
        kill_replica(replica)
        raise
    return replica


def kill_replica(replica: ReplicaProcess) -> None:
    """SIGKILL the whole process group (the replica and its tritonserver), like a lost machine."""
    try:
        os.killpg(replica.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    replica.process.wait(timeout=10)
    shutil.rmtree(replica.workspace, ignore_errors=True)


def stop_replica(replica: ReplicaProcess, grace_s: float = 10.0) -> None:
    """SIGTERM the replica and wait; SIGKILL its group if it does not stop in time."""
    if replica.process.poll() is None:
        replica.process.send_signal(signal.SIGTERM)
        try:
            replica.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # tritonserver is in the same group; make sure nothing is left holding the ports.
    try:
        os.killpg(replica.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    replica.process.wait(timeout=10)
    shutil.rmtree(replica.workspace, ignore_errors=True)
