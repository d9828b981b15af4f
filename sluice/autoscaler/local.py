"""LocalProcessProvider: replicas as `python -m sluice.replica.serve` processes on this host.

A start is a real cold start: the process boots Triton and its engine (about 3-6 s for the
timing and simple engines on the dev box, more with executor = "model"), and start() returns
when it printed its ready line. Each replica gets three free ports and a name `<pool>-as-<hex>`
(unique across autoscaler restarts, so a registry row of a dead predecessor never names a live
process), and runs in its own session so stop() can end it with its tritonserver.

Its configuration travels as SLUICE_REPLICAS (one entry, with the pool's `replica = {…}` table),
so the replica host parses it like any configured replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.autoscaler.provider import (
    DEFAULT_KV_BLOCKS,
    OWNED_INFIX,
    ProviderError,
    ReplicaHandle,
    replica_section,
)
from sluice.config import Settings
from sluice.replica.protocol import MODEL_NAME

READY_MARKER = f"ready model={MODEL_NAME}"   # replica.serve's line once Triton serves
POLL_S = 0.1
ERR_EXITED = "replica {name} exited with {code} before it was ready (log {log})"
ERR_NOT_READY = "replica {name} not ready after {seconds:.0f} s (log {log}); stopped it"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports free right now (the OS picks them; held open together so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                   for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def spawn_replica(name: str, env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The replica host in its own session (its tritonserver joins the group), output to its log."""
    with log_path.open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "sluice.replica.serve", "--name", name],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass(frozen=True, slots=True)
class _Process:
    handle: ReplicaHandle
    process: subprocess.Popen[bytes]
    log_path: Path
    workspace: Path


class LocalProcessProvider:
    outlives_autoscaler = False      # its replicas are its children

    def __init__(self, config: Settings, replica: Mapping[str, Any], log_dir: Path, *,
                 start_timeout_s: float = 300.0, stop_grace_s: float = 10.0, host: str = "127.0.0.1") -> None:
        self._config = config
        self._replica = dict(replica)          # the pool's [replica] keys over the shared section
        self._section = replica_section(config, self._replica)
        self._log_dir = log_dir
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        self._host = host
        self._processes: dict[str, _Process] = {}

    async def refresh(self, pool: str) -> None:
        """Nothing to read: list() polls the processes."""

    async def adopt(self, pool: str) -> list[ReplicaHandle]:
        return []                    # every process it runs, it started

    async def start(self, pool: str) -> ReplicaHandle:
        name = f"{pool}{OWNED_INFIX}{uuid.uuid4().hex[:6]}"
        grpc_port, http_port, metrics_port = free_ports(3, self._host)
        section = self._section
        handle = ReplicaHandle(
            name=name, pool=pool, grpc_address=f"{self._host}:{grpc_port}",
            metrics_url=f"http://{self._host}:{metrics_port}/metrics", block_size=section.block_size,
            kv_capacity_blocks=section.num_blocks or DEFAULT_KV_BLOCKS)
        entry = {"name": name, "pool": pool, "grpc_address": handle.grpc_address, "http_port": http_port,
                 "metrics_port": metrics_port, "replica": self._replica}
        env = {**os.environ, "SLUICE_REPLICAS": json.dumps([entry])}
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"replica-{name}.log"
        process = spawn_replica(name, env, log_path)
        workspace = self._config.data_dir() / "replicas" / f"{name}-{grpc_port}"
        started = _Process(handle, process, log_path, workspace)
        self._processes[name] = started
        try:
            await self._wait_ready(started)
        except BaseException:
            await self.stop(name)
            raise
        return handle

    async def _wait_ready(self, started: _Process) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        name = started.handle.name
        while READY_MARKER not in started.log_path.read_text(errors="replace"):
            code = started.process.poll()
            if code is not None:
                raise ProviderError(ERR_EXITED.format(name=name, code=code, log=started.log_path))
            if time.monotonic() > deadline:
                raise ProviderError(ERR_NOT_READY.format(name=name, seconds=self._start_timeout_s,
                                                         log=started.log_path))
            await asyncio.sleep(POLL_S)

    async def stop(self, name: str) -> None:
        """SIGTERM, then SIGKILL of its process group after the grace (tritonserver is in it)."""
        started = self._processes.pop(name, None)
        if started is None:
            return
        process = started.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(process.wait, self._stop_grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.to_thread(process.wait)
        shutil.rmtree(started.workspace, ignore_errors=True)

    def list(self, pool: str) -> list[ReplicaHandle]:
        return [started.handle for started in self._processes.values()
                if started.handle.pool == pool and started.process.poll() is None]

    def log_path(self, name: str) -> Path | None:
        started = self._processes.get(name)
        return None if started is None else started.log_path

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(name) for name in list(self._processes)))
